"""``model.to(dtype)`` after the optimizer was built, at stages 0-2 on 1-2 gloo ranks, against ``torch.optim.AdamW``.

The next backward (stages 0-1) or step (stage 2) raises a ``ValueError`` naming a parameter, its dtype now and the
one the optimizer holds, and the fix (cast before building); at stages 0-1 it used to be torch's "attempting to
assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'", naming nothing. Cast back (the
values keep the rounding, as they do for AdamW's model), the gradients cleared, training goes on next to AdamW.
Stage 3: ``tests/stages/stage3``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lockstep import LR, ROWS, batch, forward_backward, make_models, make_opt, step_and_compare

REPLACED = r"parameter '[\w.]+' was replaced after the optimizer was built and is now torch\.{}.*before building"


def cast_case(rank: int, world: int, stage: int) -> None:
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, stage), torch.optim.AdamW(ref.parameters(), lr=LR)
    for step, cast in enumerate((torch.bfloat16, torch.float64)):
        forward_backward(model, ref, rank, world, stage, 2 * step)
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} step {2 * step}")
        model.to(cast)
        x = batch(99, world * ROWS)[rank * ROWS : (rank + 1) * ROWS].to(cast)
        with pytest.raises(ValueError, match=REPLACED.format(str(cast).split(".")[1])):
            model(x).backward()
            opt.step()
        model.float()
        ref.to(cast).float()
        opt.zero_grad()
        forward_backward(model, ref, rank, world, stage, 2 * step + 1)
        step_and_compare(opt, ropt, model, ref, f"stage {stage} world {world} step {2 * step + 1} after the cast")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2], ids=lambda w: f"world{w}")
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_cast_after_build_is_refused_naming_a_parameter(spawn, stage: int, world: int) -> None:
    spawn(cast_case, world, stage)

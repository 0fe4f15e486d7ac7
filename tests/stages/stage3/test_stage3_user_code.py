"""Stage 3 under what user code does to a model, on 1-2 gloo ranks.

- An evaluation under ``torch.inference_mode()`` before the first training forward (a sanity check),
  through the model or ``gathered_params()``, then training with more such evaluations between steps,
  matches ``torch.optim.AdamW`` on the whole batch element by element after every step (the first
  gather used to make the unit's buffer an inference tensor that no later gather could refill).

Tolerances of DESIGN.md for fp32, as ``tests.helpers.lockstep.compare``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.check import assert_close
from tests.helpers.lockstep import LR, ROWS, batch, compare, forward_backward, make_models, make_opt

WORLDS = (1, 2)


def inference_first_case(rank: int, world: int, first: str) -> None:
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    x = batch(99, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]
    for step in range(3):
        with torch.inference_mode():
            if first == "forward" or step > 0:
                assert_close(model(x), ref(x), rtol=1e-5, atol=1e-7, what=f"world {world} eval before step {step}")
            else:
                with opt.gathered_params():
                    compare(model, ref, f"world {world} gathered under inference_mode")
        forward_backward(model, ref, rank, world, 3, step)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            compare(model, ref, f"world {world} ({first} first) step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("first", ["forward", "gathered_params"])
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_inference_mode_before_training(spawn, world: int, first: str) -> None:
    spawn(inference_first_case, world, first)

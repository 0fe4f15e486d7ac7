"""``zero_grad()`` between accumulation micro-steps: ignored, or refused after a backward that came after a
micro-step's ``step()``.

With ``gradient_accumulation_steps`` every micro-step calls ``step()``, and ``zero_grad()`` between micro-steps keeps
the window's gradients, as DeepSpeed's engine does: the optimizer's own call is ignored, and ``model.zero_grad()`` of a
module holding its parameters leaves the micro-steps' sum in their ``p.grad`` (stages 0-1 add micro-steps up there,
or in a buffer of a wider ``grad_accum_dtype``; stages 2-3 reduce each into the gradient shard, which torch's call
cannot reach), so every stage updates on the whole window.

A loop that backpropagates after a micro-step's ``step()`` and then clears, as torch's DCGAN loop does (the
generator's loss through the discriminator, cleared by ``netD.zero_grad()``) or an input-saliency backward, means that
backward to stay out of the update; but its gradients are mixed with the window's already (added to the micro-steps'
sum in ``p.grad``, or reduced into the shard), so the update would be wrong without a word. That ``zero_grad()`` (the
optimizer's, or ``model.zero_grad()`` of a module holding any of its parameters, checked before torch touches
``p.grad``) is refused, nothing changed. After a backward that raised, ``zero_grad()`` drops the whole window instead
(``failed_round_open``), and neither applies.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from .. import live


def mark(opt: Any) -> None:
    """A micro-step's ``step()`` (or a window put back at a micro-step): the gradients so far belong to the window."""
    opt._micro_arrivals = opt.pipeline.grad_arrivals


def _between(opt: Any) -> bool:
    """Whether ``opt`` is between micro-steps of a window that ``zero_grad()`` keeps."""
    return opt.micro_step != 0 and not opt.pipeline.failed_round_open


def pending(opt: Any) -> bool:
    """Whether gradients arrived after the window's last micro-step ``step()``, which ``zero_grad()`` cannot drop
    alone."""
    return _between(opt) and opt.pipeline.grad_arrivals != opt._micro_arrivals


def refuse(opt: Any, call: str) -> None:
    """Raise when ``call`` would clear gradients that ``pending`` says cannot be told apart from the window's."""
    if not pending(opt):
        return
    raise RuntimeError(
        f"{call} on accumulation micro-step {opt.micro_step + 1} of {opt.gradient_accumulation_steps}, after a "
        "backward that came after the last micro-step's step(): between micro-steps zero_grad() keeps the window's "
        "gradients, and that backward's are already added to them, so it would go into the update it was meant to "
        "stay out of (torch's DCGAN loop: the generator's loss backpropagated through the discriminator, cleared by "
        "netD.zero_grad(); an input-saliency backward). Keep this optimizer's parameters out of that backward: "
        "requires_grad_(False) on them around it, or loss.backward(inputs=[...]) / torch.autograd.grad for what it "
        "is for; or, if it belongs to the window, call step() after it. Nothing was changed"
    )


@contextlib.contextmanager
def module_call(module: nn.Module) -> Iterator[None]:
    """Around torch's ``module.zero_grad()``: ``refuse`` for each live optimizer between micro-steps that trains a
    parameter of ``module`` (as its owner: one built later on the same parameters takes them over, ``live.owners``),
    then keep those parameters' ``p.grad`` (the window's micro-steps) through the call."""
    ids: list[int] = []
    kept: dict[Any, Any] = {}
    for opt in live.optimizers():
        if not _between(opt):
            continue
        ids = ids or [id(p) for p in module.parameters()]
        mine = live.owned(opt, ids)
        if not mine:
            continue
        refuse(opt, f"{type(module).__name__}.zero_grad()")
        kept.update((p, p.grad) for p in live.params_of(opt) if id(p) in mine and p.grad is not None)
    for p in kept:
        p.grad = None  # out of torch's reach, whether it sets to None or zeroes in place
    try:
        yield
    finally:
        for p, grad in kept.items():
            p.grad = grad

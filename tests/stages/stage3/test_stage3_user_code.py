"""Stage 3 under what user code does to a model, on 1-2 gloo ranks.

- An evaluation under ``torch.inference_mode()`` before the first training forward (a sanity check),
  through the model or ``gathered_params()``, then training with more such evaluations between steps,
  matches ``torch.optim.AdamW`` on the whole batch element by element after every step (the first
  gather used to make the unit's buffer an inference tensor that no later gather could refill).
- ``model.to(torch.bfloat16)`` or ``model.double()`` after the optimizer was built raises ``ValueError``
  naming a parameter and the fix, at the next forward or at the step, as stage 2 does (a freed parameter's
  empty tensor took the new dtype and the next gather undid it without a word); cast back, the values keep
  the rounding, as AdamW's tensors and stages 0-2 do, also with no forward between (``model.half();
  model.float()`` used to leave the freed parameters' shards unrounded, the frozen one's too: 1.2e-4 off AdamW),
  and training goes on next to AdamW.
- A parameter written in place while its module has it gathered (``nn.Embedding(max_norm=...)``), in a
  training forward or an evaluation, on one rank only: the next step raises on every rank, naming the
  parameter and the rank, even after ``zero_grad()``, and updates nothing (the write used to be lost
  at the free). A parameter under ``stage3_param_persistence_threshold``, kept whole on every rank, is refused
  where the ranks' values then differ (each rank's step took only the rows in its own shard: a mix, without a
  word), wherever in the forward the write is made (a module that does not use it, the root's own forward, a
  pre-hook put on before the optimizer), and kept where every rank wrote the same. Writes inside
  ``gathered_params()`` are kept, and so, for a persistent parameter, are writes between steps outside any
  forward: training after them matches AdamW.
- Tensors taken inside ``gathered_params()`` (a ``state_dict()``, ``p.detach()``, an EMA swapped in through
  ``p.data``) keep their values after the block, and the model its own.
- ``torch.nn.init`` functions on a parameter between uses raise naming it (``kaiming_normal_`` did nothing);
  inside ``gathered_params()`` they initialise it.
- A forward inside a ``torch.func`` transform is refused naming ``gathered_params()``; inside the block
  ``vmap(grad(functional_call))`` gives torch's per-sample gradients.
- ``loss.backward(inputs=[...])`` naming gathered parameters (only they get gradients) trains next to AdamW doing
  the same: naming a parameter there reads none of its values.
- A parameter used with autograd outside any forward (an L2 penalty added to the loss,
  ``torch.autograd.grad(loss, params)``) is refused with a message that names what works; what it
  names for the penalty (computed in the model's forward, the parameters registered as external
  parameters of the model) trains next to AdamW with the same penalty.
- A double backward (``torch.autograd.grad(..., create_graph=True)`` for a gradient penalty,
  ``backward(create_graph=True)``) raises an error naming it (it used to fail in torch with
  "setStorage ... out of bounds"); training without it goes on next to AdamW.

Tolerances of DESIGN.md for fp32, as ``tests.helpers.lockstep.compare``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.init import kaiming_normal_ as early_kaiming_normal_

import zero_kernels as zk
import zero_kernels.optim as zo
from tests.helpers.check import assert_close
from tests.helpers.lockstep import (
    BUCKET,
    LR,
    ROWS,
    batch,
    compare,
    forward_backward,
    make_models,
    make_opt,
    step_and_compare,
)

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
        step_and_compare(opt, ropt, model, ref, f"world {world} ({first} first) step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("first", ["forward", "gathered_params"])
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_inference_mode_before_training(spawn, world: int, first: str) -> None:
    spawn(inference_first_case, world, first)


CAST = r"parameter '[\w.]+' was cast or moved after the optimizer was built and is now torch\.{}.*before building"


def round_values(model: nn.Module, dtype: torch.dtype) -> None:
    """What ``model.to(dtype).float()`` does to the values of a model whose ``p.grad`` is None (stage 3's)."""
    for p in model.parameters():
        p.data = p.data.to(dtype).float()


def cast_case(rank: int, world: int) -> None:
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    x = batch(99, world * ROWS)[rank * ROWS : (rank + 1) * ROWS]
    for step in range(4):
        cast = (torch.bfloat16, torch.float64)[step % 2]
        if step == 1:
            model.to(cast)
            with pytest.raises(ValueError, match=CAST.format(str(cast).split(".")[1])):
                model(x)
            model.float()
            round_values(ref, cast)
        forward_backward(model, ref, rank, world, 3, step)
        if step in (0, 2):
            model.to(cast)
            with pytest.raises(ValueError, match=CAST.format(str(cast).split(".")[1])):
                opt.step()
            model.float()
            round_values(ref, cast)
        if step == 3:  # cast and back with nothing between: the shards keep fp16's rounding, as AdamW's tensors do
            model.half()
            model.float()
            round_values(ref, torch.float16)
        step_and_compare(opt, ropt, model, ref, f"world {world} step {step}")
        assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_cast_after_build_is_refused(spawn, world: int) -> None:
    spawn(cast_case, world)


def cast_then_assign_case(rank: int, world: int) -> None:
    """``model.half(); model.float()`` with the parameters freed, then ``p.data = value`` (a trainable and the frozen
    parameter) before the next gather: the assigned values are taken as given, and no later gather rounds them (or
    the values the steps made of them) through fp16 again."""
    model, ref = make_models(torch.float32)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    new = {"emb.weight": torch.randn(11, 6, generator=torch.Generator().manual_seed(7)), "frozen": torch.randn(5) * 3}
    for step in range(4):
        if step == 1:
            model.half()
            model.float()
            round_values(ref, torch.float16)
            for m in (model, ref):
                params = dict(m.named_parameters())
                for name, value in new.items():
                    params[name].data = value.clone()
        forward_backward(model, ref, rank, world, 3, step)
        step_and_compare(opt, ropt, model, ref, f"world {world} step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_cast_then_assigned_values_are_not_rounded(spawn, world: int) -> None:
    spawn(cast_then_assign_case, world)


WRITTEN = r"parameter '0\.weight' \(optimizer index 0\) was written in place.*max_norm.*nothing was updated"


def embedding_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).square().mean()


PERSISTENT_WRITTEN = (
    r"parameter '0\.weight' \(optimizer index 0\), kept whole on every rank .*written in place during a forward, "
    r"and the ranks now hold different values.*nothing was updated"
)


def refused_write(
    model: nn.Module, opt: zo.ShardedFusedAdam, tokens: torch.Tensor, rank: int, world: int, persistent: bool
) -> None:
    """A forward that renormalises rows on rank 0 only (under no_grad, then a plain training forward; or in the
    training forward): the step raises on every rank."""
    where = r" \(found on rank 0 of 2; every rank raises\)" if world == 2 else "$"
    pattern = PERSISTENT_WRITTEN if persistent else WRITTEN + where
    for evaluation in (True, False):
        model[0].max_norm = 1.0 if rank == 0 else None
        if evaluation:
            with torch.no_grad():
                model(tokens)
            model[0].max_norm = None
            opt.zero_grad()
        embedding_loss(model, tokens).backward()
        with pytest.raises(RuntimeError, match=pattern):
            opt.step()
        opt.zero_grad()
        model[0].max_norm = None


def _embedding_models(threshold: int) -> tuple[nn.Module, nn.Module, zo.ShardedFusedAdam, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    ref = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(
        model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=threshold
    )
    return model, ref, opt, torch.optim.AdamW(ref.parameters(), lr=LR)


def forward_write_case(rank: int, world: int, threshold: int) -> None:
    """``threshold``: 0 shards the embedding; the default keeps it whole on every rank (persistent). There a write
    that differs between the ranks is refused (on one rank nothing differs: every write is kept) and stays in the
    writing rank's copy, as torch keeps it (so training starts again from a new model); the same write on every rank
    during a forward (the same rows renormalised), and a write between steps outside any forward, are edits the
    step takes, as AdamW's."""
    model, ref, opt, ropt = _embedding_models(threshold)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 1]])
    mine = tokens[rank : rank + 1] if world == 2 else tokens
    if not threshold or world == 2:
        refused_write(model, opt, mine, rank, world, persistent=bool(threshold))
    if threshold:
        model, ref, opt, ropt = _embedding_models(threshold)
    with opt.gathered_params(), torch.no_grad():
        model[0].weight.mul_(0.5)
    with torch.no_grad():
        ref[0].weight.mul_(0.5)
        if threshold:
            model[0].weight.clamp_(-0.3, 0.3)
            ref[0].weight.clamp_(-0.3, 0.3)
    for step in range(2):
        if threshold and step == 1:  # every rank renormalises the same rows in a forward
            for m in (model, ref):
                m[0].max_norm = 0.1
                with torch.no_grad():
                    m(tokens)
                m[0].max_norm = None
        embedding_loss(model, mine).backward()
        embedding_loss(ref, tokens).backward()
        step_and_compare(opt, ropt, model, ref, f"world {world} step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
@pytest.mark.parametrize("threshold", [0, 100_000], ids=["sharded", "persistent"])
def test_write_in_place_during_forward_is_refused(spawn, world: int, threshold: int) -> None:
    spawn(forward_write_case, world, threshold)


class Writers(nn.Module):
    """``b.weight`` (persistent) halved in place during the forward, while ``self.halve``: by the root's own forward,
    by its sibling ``a``'s forward (which does not use it), or by a pre-hook on ``b`` put on before the optimizer."""

    def __init__(self, where: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.where, self.halve = nn.Linear(4, 4), nn.Linear(4, 1), where, False
        self.a.register_forward_hook(lambda *_: self._write("sibling"))
        self.b.register_forward_pre_hook(lambda *_: self._write("pre-hook"))

    def _write(self, where: str) -> None:
        if self.halve and self.where == where:
            with torch.no_grad():
                self.b.weight.mul_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._write("root")
        return self.b(self.a(x))


def persistent_write_elsewhere_case(rank: int, world: int, where: str) -> None:
    """A write that differs between the ranks is refused on every rank wherever in the forward it is made; the same
    write on every rank trains as AdamW with that write."""
    model, ref = Writers(where), Writers(where)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=100_000)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    mine = x.chunk(world)[rank]
    model.halve = rank == 0
    model(mine).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"parameter 'b\.weight' .*kept whole on every rank .*ranks now hold"):
        opt.step()
    opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    for step in range(2):
        model.halve = ref.halve = step == 1
        model(mine).square().mean().backward()
        ref(x).square().mean().backward()
        step_and_compare(opt, ropt, model, ref, f"{where} write, step {step}")


def persistent_write_qwz_case(rank: int, world: int) -> None:
    """With qwZ each rank holds the other ranks' parts of a persistent parameter dequantized (its bits differ by
    design): the same write on every rank (a ``clamp_`` in the forward) trains on (it was refused from the second
    step), and a write on one rank only is refused."""
    model = Writers("root")
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, zero_quantized_weights=True)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    for step in range(3):
        model.halve = True
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.halve = rank == 0
    model(x).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"parameter 'b\.weight' .*kept whole on every rank"):
        opt.step()


@pytest.mark.distributed
def test_persistent_writes_with_quantized_weights(spawn) -> None:
    spawn(persistent_write_qwz_case, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["root", "sibling", "pre-hook"])
def test_persistent_write_anywhere_in_the_forward_is_found(spawn, where: str) -> None:
    spawn(persistent_write_elsewhere_case, 2, where)


def backward_inputs_case(rank: int, world: int) -> None:
    """``backward(inputs=...)`` naming gathered parameters (only those get gradients: train part of the model this
    step) reads no values: it runs as without ``inputs`` and trains next to AdamW doing the same."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    picks = [
        lambda m: {"inputs": [m.emb.weight, m.head.weight]},
        lambda m: {"inputs": [m.mid.weight]},
        lambda m: {},
    ]
    for step, pick in enumerate(picks):
        x = batch(step, world * ROWS)
        loss = model(x[rank * ROWS : (rank + 1) * ROWS])
        if step == 1:
            torch.autograd.backward(loss, **pick(model))
        else:
            loss.backward(**pick(model))
        ref(x).backward(**pick(ref))
        step_and_compare(opt, ropt, model, ref, f"world {world} backward(inputs=...) step {step}")


def _hand_grad(shape: torch.Size, step: int, k: int, rank: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + 10 * k + rank))


def hand_set_grad_case(rank: int, world: int) -> None:
    """``p.grad = g`` of the full shape on a parameter between uses raises naming it and ``gathered_params()``
    (torch's own error named neither); set there, the gradients train next to AdamW given their mean."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    shapes = {n: q.shape for n, q in ref.named_parameters()}
    with pytest.raises(RuntimeError, match=r"parameter 'emb\.weight' is used \(p\.grad = \.\.\.\).*gathered_params"):
        model.emb.weight.grad = torch.ones(shapes["emb.weight"])
    assert model.emb.weight.grad is None
    for step in range(2):
        with opt.gathered_params():
            for k, (n, q) in enumerate(model.named_parameters()):
                if q.requires_grad:
                    q.grad = _hand_grad(shapes[n], step, k, rank)
        for k, (n, q) in enumerate(ref.named_parameters()):
            if q.requires_grad:
                q.grad = torch.stack([_hand_grad(shapes[n], step, k, r) for r in range(world)]).mean(0)
        step_and_compare(opt, ropt, model, ref, f"world {world} gradients set by hand, step {step}")


def kept_from_gathered_params_case(rank: int, world: int) -> None:
    """What ``gathered_params()`` hands out outlives the block, as torch's tensors do: a ``state_dict()`` and
    ``p.detach()`` taken there keep their values after it (reading them used to crash: their storage was emptied;
    those of a persistent parameter view it, as torch's, and so follow the steps), and an EMA swapped in by
    ``p.data, e.data = e.data, p.data`` and out again leaves both the model and the EMA as they were (the model used
    to end up with the EMA's values, the EMA on an emptied storage); training goes on next to AdamW."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    forward_backward(model, ref, rank, world, 3, 0)
    step_and_compare(opt, ropt, model, ref, f"world {world} step 0")
    with opt.gathered_params():
        state = model.state_dict()
        detached = [q.detach() for q in model.parameters()]
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    ema = [torch.full_like(q, 0.5) for q in ref.parameters()]
    for swap in range(2):
        with opt.gathered_params(modifier_rank=0 if swap else None):  # the broadcast took the swap apart too
            for e, q in zip(ema, model.parameters()):
                q.data, e.data = e.data, q.data
            if swap == 0:
                assert all(bool((q == 0.5).all()) for q in model.parameters()), "EMA not swapped in"
    assert all(bool((e == 0.5).all()) for e in ema), "the EMA lost its values"
    for (k, v), q in zip(state.items(), detached):  # two blocks gathered and freed the units since
        assert_close(v, want[k], rtol=1e-5, atol=1e-6, what=f"state_dict()[{k!r}] kept from gathered_params()")
        assert_close(q, want[k], rtol=1e-5, atol=1e-6, what=f"{k}.detach() kept from gathered_params()")
    for step in (1, 2):
        forward_backward(model, ref, rank, world, 3, step)
        step_and_compare(opt, ropt, model, ref, f"world {world} step {step} after the EMA went in and out")
    assert all(bool(v.isfinite().all()) for v in [*state.values(), *detached, *ema]), "kept tensors readable"


INITS = [
    lambda w: nn.init.kaiming_normal_(w),
    lambda w: nn.init.xavier_uniform_(w),
    lambda w: nn.init.orthogonal_(w),
    lambda w: nn.init.eye_(w),
    lambda w: nn.init.kaiming_uniform_(w),
    lambda w: early_kaiming_normal_(w),  # bound by name before any optimizer existed
    lambda w: torch.nn.modules.activation.xavier_uniform_(w),  # how MultiheadAttention._reset_parameters calls it
]


def init_case(rank: int, world: int) -> None:
    """``torch.nn.init`` on a parameter between uses raises naming it and ``gathered_params()``, whether or not the
    function dispatches ``__torch_function__`` (``kaiming_normal_`` did nothing, ``xavier_uniform_`` failed naming no
    parameter); inside the block it initialises the parameter, which then trains next to AdamW."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    for init in INITS:
        with pytest.raises(RuntimeError, match=r"parameter 'emb\.weight' .*gathered_params"):
            init(model.emb.weight)
    with opt.gathered_params():
        nn.init.kaiming_normal_(model.emb.weight, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        nn.init.kaiming_normal_(ref.emb.weight, generator=torch.Generator().manual_seed(3))
    for step in range(2):
        forward_backward(model, ref, rank, world, 3, step)
        step_and_compare(opt, ropt, model, ref, f"world {world} initialised in the block, step {step}")


def test_parameters_tell_their_full_size_as_deepspeed_does() -> None:
    """Between uses a parameter reports shape (0,), as DeepSpeed's; ``ds_shape`` and ``ds_numel`` give the full size
    (what PEFT's parameter count and the Hugging Face Trainer's read under ZeRO-3)."""
    model, ref = make_models(torch.float32)
    make_opt(model, 3)
    freed = [n for n, q in model.named_parameters() if q.numel() == 0]
    assert freed, "nothing freed: the test would prove nothing"
    for (name, q), r in zip(model.named_parameters(), ref.parameters()):
        if hasattr(q, "ds_shape"):
            assert (q.ds_shape, q.ds_numel) == (r.shape, r.numel()), name
        else:
            assert name not in freed and q.shape == r.shape, name
    count = sum(q.ds_numel if q.numel() == 0 else q.numel() for q in model.parameters())  # PEFT's count
    assert count == sum(r.numel() for r in ref.parameters())


def _per_sample_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch's per-sample gradients recipe: ``vmap(grad(functional_call))``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps: dict[str, torch.Tensor], row: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, ps, (row[None],))

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)


def torch_func_case(rank: int, world: int) -> None:
    """A forward inside a ``torch.func`` transform is refused naming ``gathered_params()`` (the first gather made
    there left a buffer that crashed the next forward); inside the block it gives torch's per-sample gradients, and
    training goes on next to AdamW."""
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    x = batch(7, 3)
    with pytest.raises(RuntimeError, match=r"inside a torch\.func transform .*gathered_params"):
        _per_sample_grads(model, x)
    with opt.gathered_params():
        got = _per_sample_grads(model, x)
    for name, want in _per_sample_grads(ref, x).items():
        assert_close(got[name], want, rtol=1e-5, atol=1e-6, what=f"per-sample gradient of {name}")
    for step in range(2):
        forward_backward(model, ref, rank, world, 3, step)
        step_and_compare(opt, ropt, model, ref, f"world {world} after torch.func, step {step}")


def saved_views_case(rank: int, world: int) -> None:
    """A ``gathered_params()`` block between a forward and its backward keeps nothing: the storages the forward's
    saved views share are emptied at the block's end as at any free (they were left to autograd, holding the whole
    model through the backward); the backward then trains next to AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    ref = copy.deepcopy(model)
    opt = zo.ShardedFusedAdam(model, lr=LR, eps=1e-3, stage=3, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-3)
    saved: dict[int, torch.UntypedStorage] = {}  # the storages of the parameters' saved views

    def pack(t: torch.Tensor) -> torch.Tensor:
        if any(t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() for q in model.parameters()):
            saved[id(t.untyped_storage())] = t.untyped_storage()
        return t

    x = torch.randn(2 * world, 64, generator=torch.Generator().manual_seed(5))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x.chunk(world)[rank]).square().mean()
    with opt.gathered_params():
        pass
    assert saved, "no saved view of a parameter: the test would prove nothing"
    held = sum(s.nbytes() for s in saved.values())
    assert held == 0, f"the forward's saved views of the parameters hold {held} bytes after the block"
    loss.backward()
    ref(x).square().mean().backward()
    step_and_compare(opt, ropt, model, ref, f"world {world} a block between forward and backward")


USER_CODE = [
    backward_inputs_case,
    hand_set_grad_case,
    kept_from_gathered_params_case,
    init_case,
    torch_func_case,
    saved_views_case,
]


@pytest.mark.distributed
@pytest.mark.parametrize("case", USER_CODE, ids=lambda case: case.__name__)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_user_code_next_to_adamw(spawn, world: int, case) -> None:
    spawn(case, world)


LAM = 1e-2


class Penalised(nn.Module):
    """``net``'s loss plus ``LAM`` x the sum of the squares of its trainable parameters (``inside``: computed here)."""

    def __init__(self, inside: bool) -> None:
        super().__init__()
        self.net, self.inside = make_models(torch.float32)[0], inside

    def penalty(self) -> torch.Tensor:
        return LAM * sum(p.square().sum() for p in self.net.parameters() if p.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.penalty() if self.inside else self.net(x)


def refused_outside(model: Penalised, x: torch.Tensor) -> None:
    """The penalty and ``autograd.grad`` outside the forward: errors naming what works."""
    with pytest.raises(RuntimeError, match=r"'net\.tiny'.*register_external_parameter.*without gradients"):
        model(x) + model.penalty()
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match=r"autograd\.grad with respect to parameters is not supported"):
        torch.autograd.grad(model(x), params)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"'net\.tiny'.*inside `with optimizer\.gathered"):
        model.penalty()


def penalty_case(rank: int, world: int) -> None:
    model, ref = Penalised(inside=False), Penalised(inside=True)
    for p in model.net.parameters():
        zk.register_external_parameter(model, p)
    opt = zo.ShardedFusedAdam(model, lr=LR, stage=3, reduce_bucket_size=BUCKET, stage3_param_persistence_threshold=0)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR)
    x = batch(0, world * ROWS)
    refused_outside(model, x[rank * ROWS : (rank + 1) * ROWS])
    model.inside = True
    for step in range(3):
        x = batch(step, world * ROWS)
        model(x[rank * ROWS : (rank + 1) * ROWS]).backward()
        ref(x).backward()
        step_and_compare(opt, ropt, model, ref, f"world {world} step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_parameter_used_with_autograd_outside_a_forward(spawn, world: int) -> None:
    spawn(penalty_case, world)


DOUBLE = r"create_graph=True \(double backward.*not supported"


def double_backward_case(rank: int, world: int) -> None:
    model, ref = make_models(torch.float32)
    opt, ropt = make_opt(model, 3), torch.optim.AdamW(ref.parameters(), lr=LR)
    x = batch(0, world * ROWS)[rank * ROWS : (rank + 1) * ROWS].requires_grad_(True)
    with pytest.raises(RuntimeError, match=DOUBLE):
        torch.autograd.grad(model(x), x, create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE):
        model(x).backward(create_graph=True)
    opt.zero_grad()
    for step in range(2):
        forward_backward(model, ref, rank, world, 3, step)
        step_and_compare(opt, ropt, model, ref, f"world {world} step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
def test_double_backward_is_refused(spawn, world: int) -> None:
    spawn(double_backward_case, world)

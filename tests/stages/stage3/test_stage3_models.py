"""Stage 3 on the shapes of real models, in lock-step with ``torch.optim.AdamW`` on the whole batch.

- A mixture of experts (top-1 routing, 4 experts) whose ranks route their rows to different
  experts trains correctly once its block is a leaf module, marked before or after the optimizer.
- Ranks that gather different modules raise ``CommError`` on every rank, with the same sizes (which
  used to mix the modules' parameters silently) and different sizes (which used to kill a rank).
  On a backend other than gloo the check runs on a gloo group of the same ranks (host only).
- A parameter read outside its module (``F.linear(h, self.embed.weight)``, a tied output embedding)
  is gathered for the module that reads it, registered or found on first use; read outside any
  forward it raises an error naming it.
- ``torch.compile`` (aot_eager) at every stage.

Tolerances as in ``test_stage3.py``: fp32, ``rtol=1e-5`` with ``atol = 1e-6 x`` the tensor's largest
magnitude, after every step.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_kernels as zk
from tests.helpers.check import assert_close
from tests.helpers.dist import run_ranks
from tests.stages.stage3.test_stage3 import FakeUnit, Lin, _events
from zero_kernels.comm import CommError, TorchCommEngine
from zero_kernels.control import ControlLink
from zero_kernels.model_hints import external_parameters
from zero_kernels.stages import stage3_guard
from zero_kernels.stages.stage3_check import check_same_units, explain_failed_gather
from zero_kernels.stages.stage3_hooks import Stage3Scheduler

DIM, EXPERTS, ROWS, LR = 6, 4, 2, 2e-2
# Per step, the expert each row of rank r is routed to: rank 0 uses every expert in steps 0 and 2 (its
# gradients are complete when its backward reaches the block, the others' are not), no rank uses
# expert 3 in step 1 (it gets no gradient: AdamW leaves it alone).
ROUTES = (
    ((0, 1, 2, 3), (1, 2, 1, 2), (0, 2, 0, 2)),
    ((0, 1, 2, 0), (1, 2, 1, 1), (2, 0, 0, 2)),
    ((3, 2, 1, 0), (2, 2, 2, 2), (0, 1, 0, 1)),
)
MOE_ROWS = 4
SMALL = dict(stage3_param_persistence_threshold=0, reduce_bucket_size=16)


def _compare(model: nn.Module, ref: nn.Module, what: str) -> None:
    """Every element of every parameter (stage 3: inside ``gathered_params``)."""
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, r, rtol=1e-5, atol=1e-6 * r.detach().abs().max().item(), what=f"{what} {name}")


def _train(
    rank: int, world: int, model: nn.Module, ref: nn.Module, opt, batches, what: str, forward=None, rows: int = ROWS
) -> None:
    """Steps of ``model`` on this rank's rows next to AdamW and ``ref`` on all rows; compares after every step."""
    forward = forward or (lambda m, x: m(x))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    for step, x in enumerate(batches):
        forward(model, x[rank * rows : (rank + 1) * rows]).backward()
        opt.step()
        opt.zero_grad()
        forward(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.gathered_params():
            _compare(model, ref, f"{what} world {world} step {step}")


# -- the schedule with fake units, in one process ------------------------------------------------------


class Pair(nn.Module):
    """Lin modules ``x`` then ``y``; ``y`` only when ``both``: a module whose inside depends on the call."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.x, self.y = Lin("x", 4, log), Lin("y", 4, log)
        self.both = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.x(h)
        return self.y(h) if self.both else h


class Outer(nn.Module):
    def __init__(self, log: list) -> None:
        super().__init__()
        self.a, self.pair = Lin("a", 4, log), Pair(log)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.pair(self.a(h)).sum()


class Tied(nn.Module):
    """The root reads ``a.weight`` after ``a`` has run."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.a, self.b = Lin("a", 4, log), Lin("b", 4, log)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (self.b(self.a(h)) @ self.a.weight).sum()


def _scheduled(model: nn.Module, modules: dict[str, nn.Module], log: list) -> list[FakeUnit]:
    """A fake unit per module of ``modules``, scheduled with a check that logs every batch before its gathers."""
    units = [FakeUnit(tag, m.parameters(), log) for tag, m in modules.items()]

    def check(batch: list[int], phase: str, deferred: bool = False) -> None:
        log.append(("check", "+".join(units[i].tag for i in batch) + "@" + phase))

    model.scheduler = Stage3Scheduler(model, units, prefetch_numel=0, check=check)  # its hooks hold it weakly
    return units


def test_leaf_module_is_gathered_whole_and_reduced_when_its_backward_ends() -> None:
    log: list = []
    model = Outer(log)
    zk.set_leaf_modules(model, [Pair])
    units = _scheduled(model, {"a": model.a, "x": model.pair.x, "y": model.pair.y}, log)
    x = torch.randn(2, 4)
    fwd = "check:a@forward gather:a wait:a fwd:a free:a check:x+y@forward gather:x gather:y wait:x wait:y "
    bwd = "check:x+y@backward gather:x gather:y wait:x wait:y "
    end = "reduce:x free:x reduce:y free:y check:a@backward gather:a wait:a bwd:a reduce:a free:a"
    model(x).backward()
    assert log == _events(fwd + "fwd:x fwd:y free:x free:y " + bwd + "bwd:y bwd:x " + end)
    log.clear()
    model.pair.both = False  # y is not run: the leaf gathers, frees and reduces it all the same
    model(x).backward()
    assert log == _events(fwd + "fwd:x free:x free:y " + bwd + "bwd:x " + end)
    assert [[g is None for g in unit.grads[-1]] for unit in units] == [[False, False], [False, False], [True, True]]


def test_parameter_read_outside_its_module_is_gathered_for_the_reader() -> None:
    log: list = []
    model = Tied(log)
    _scheduled(model, {"a": model.a, "b": model.b}, log)
    x = torch.randn(2, 4)
    model(x).backward()  # the root's read of a.weight gathers it there (and registers it)
    fwd = "check:a@forward gather:a wait:a fwd:a free:a check:b@forward gather:b wait:b fwd:b free:b "
    bwd = "check:a@backward gather:a wait:a check:b@backward gather:b wait:b bwd:b reduce:b free:b "
    bwd += "bwd:a reduce:a free:a"
    assert log == _events(fwd + "check:a@forward gather:a wait:a free:a " + bwd)
    assert [p is model.a.weight for p in external_parameters(model)] == [True]
    log.clear()
    model(x).backward()  # now the root gathers it before its forward and holds it until its end
    fwd = "check:a@forward gather:a wait:a fwd:a check:b@forward gather:b wait:b fwd:b free:b free:a "
    assert log == _events(fwd + bwd)


class ReadsChild(nn.Module):
    """Holds no parameter itself: reads its child's weight directly and calls the child."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.lin.weight) + self.lin(x))


class Recomputed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ReadsChild()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: self.inner(self.inner(t)), x, use_reentrant=False)
        return self.head(h).sum()


def test_a_recomputed_read_of_a_parameter_found_for_the_module_around_it_says_where_to_register_it() -> None:
    """A module without parameters of its own reads its child's weight in a checkpointed segment: found on first use,
    the weight is gathered for the root's forward, which the recomputation in backward does not run. The error names
    the module it went to and the fix (it read as an L2 penalty computed outside the forward); registered for the
    module that reads it, the model trains as AdamW."""
    torch.manual_seed(0)
    model = Recomputed()
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    with pytest.raises(RuntimeError, match=r"gathered for the forward of '<root>'.*register_external_parameter"):
        model(torch.randn(3, 4)).backward()
    torch.manual_seed(0)
    model = Recomputed()
    ref = copy.deepcopy(model)
    zk.register_external_parameter(model.inner, model.inner.lin.weight)
    opt = zk.ShardedFusedAdam(model, lr=1e-2, stage=3, stage3_param_persistence_threshold=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).backward()
            o.step()
            o.zero_grad()
        with opt.gathered_params():
            _compare(model, ref, f"registered, step {step}")


def test_freed_parameter_calls_back_on_operations_not_on_metadata() -> None:
    calls: list[str] = []

    class Owner:
        def on_use(self, p: nn.Parameter, func) -> None:
            calls.append(stage3_guard.operation_name(func))
            stage3_guard.mark_gathered(p)
            p.data = torch.ones(3)

    owner, p = Owner(), nn.Parameter(torch.ones(3))
    p.data = torch.empty(0)
    stage3_guard.mark_freed(p, owner.on_use)
    assert isinstance(p, nn.Parameter) and type(p) is not nn.Parameter
    metadata = (p.shape, p.numel(), p.dtype, p.grad, p.requires_grad, p.detach().numel())
    assert metadata == ((0,), 0, torch.float32, None, True, 0)
    lin = nn.Linear(2, 2)
    for q in lin.parameters():
        q.data = torch.empty(0)
        stage3_guard.mark_freed(q, owner.on_use)
    lin.to(torch.device("cpu", 0)).half()  # the conversions frameworks apply to a built model pass
    assert calls == []
    assert torch.cat([p, p]).tolist() == [1.0] * 6, "the callback runs first: the operation sees the gathered value"
    assert calls == ["torch.cat"] and type(p) is nn.Parameter


# -- ranks that gather different modules ----------------------------------------------------------------


class Fork(nn.Module):
    """``a``, then ``left`` or ``right`` as the caller says (``right`` without bias: another size)."""

    def __init__(self, same_size: bool) -> None:
        super().__init__()
        self.a, self.left, self.right = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4, bias=same_size)

    def forward(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return getattr(self, which)(self.a(x)).square().mean()


def _divergence_cases(rank: int, world: int) -> None:
    x = torch.randn(ROWS, 4)
    for same_size in (True, False):
        torch.manual_seed(0)
        model = Fork(same_size)
        # held: a stage-3 optimizer let go at once takes the parameters' values with it
        _opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **SMALL, stage3_prefetch_bucket_size=0)
        with pytest.raises(CommError) as err:
            model(x, "left" if rank == 0 else "right")
        text = str(err.value)
        right = "20" if same_size else "16"
        assert "the ranks gather different parameters at the same point of the forward" in text, text
        assert "rank 0 gathers the parameters of 'left' (Linear, 20 elements); " in text, text
        assert f"rank 1 gathers the parameters of 'right' (Linear, {right} elements)" in text, text
        assert "zero_kernels.set_leaf_modules(model, [" in text, text
    torch.manual_seed(0)
    model = MoENet()
    _opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **SMALL, stage3_prefetch_bucket_size=0)
    with pytest.raises(CommError) as err:
        model(_moe_batches(world)[0][rank * MOE_ROWS : (rank + 1) * MOE_ROWS])
    text = str(err.value)
    assert "rank 0 gathers the parameters of 'moe.experts.0.up' (Linear, 56 elements)" in text, text
    assert "rank 1 gathers the parameters of 'moe.experts.1.up' (Linear, 56 elements)" in text, text
    assert "closest module around both is 'moe' (MoEBlock)" in text, text
    assert "set_leaf_modules(model, [MoEBlock])" in text, text


def _later_divergence(rank: int, world: int) -> None:
    """Rank 1 leaves the modules of the first, checked forward in the second while rank 0 repeats them: rank 1 checks
    at once where rank 0 gathers (its check deferred), so the collectives do not pair up (the C++ engine says so, the
    torch engine times out); both errors name the likely cause and the fix."""
    torch.manual_seed(0)
    model = Fork(same_size=False)
    _opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **SMALL, stage3_prefetch_bucket_size=0)
    x = torch.randn(ROWS, 4)
    model(x, "left").backward()
    with pytest.raises(CommError) as err:
        model(x, "left" if rank == 0 else "right")
    assert "some ranks run other modules than the others" in str(err.value), str(err.value)
    assert "zero_kernels.set_leaf_modules(model, [ThatModuleClass])" in str(err.value), str(err.value)


@pytest.mark.distributed
def test_ranks_that_leave_a_checked_forward_order_are_told_why_their_collectives_failed() -> None:
    run_ranks(_later_divergence, 2, timeout_s=10.0)


class FrozenAfterScale(nn.Module):
    """A frozen (partitioned) ``f`` whose input is scaled by a trainable ``scale`` where the caller says so: only there
    does its input need a gradient, and only there does its backward gather ``f``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + torch.randn(4) / 10)
        self.f, self.m = nn.Linear(4, 4, bias=False).requires_grad_(False), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scaled: bool) -> torch.Tensor:
        return self.m(torch.tanh(self.f(x * self.scale if scaled else x))).square().mean()


def _frozen_input_on_some_ranks(rank: int, world: int, fixed: bool) -> None:
    """Rank 1 stops scaling at the second step: the gather of ``f`` in rank 0's backward fails naming the cause and
    the fix (rank 1's reduction fails where it meets that gather); with the fix (an input that needs a gradient on
    every rank) the model trains as AdamW on the mean of the ranks' losses."""
    xs = [torch.randn(world, ROWS, 4, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    torch.manual_seed(0)
    model = FrozenAfterScale()
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **SMALL, stage3_prefetch_bucket_size=0)
    ref_opt = torch.optim.AdamW([ref.scale, *ref.m.parameters()], lr=LR, weight_decay=0.1)
    for step, x in enumerate(xs):
        scaled = [r == 0 or step == 0 for r in range(world)]
        if step == 1 and not fixed:
            with pytest.raises(CommError) as err:
                model(x[rank], scaled[rank]).backward()
            if rank == 0:
                assert "give that input a gradient on every rank (`x.requires_grad_()`" in str(err.value), err.value
            return
        model(x[rank].requires_grad_(fixed), scaled[rank]).backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(x[r], scaled[r]) for r in range(world)) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.gathered_params():
            _compare(model, ref, f"step {step}")


@pytest.mark.distributed
@pytest.mark.parametrize("fixed", [False, True])
def test_a_frozen_module_whose_input_needs_a_gradient_on_some_ranks_only(fixed: bool) -> None:
    run_ranks(_frozen_input_on_some_ranks, 2, fixed, timeout_s=20.0)


def test_a_failed_gather_is_explained_only_where_the_collectives_did_not_pair_up() -> None:
    timeout = CommError("all_gather of bucket 'gather.0' failed: Timed out waiting 5000ms for recv operation")
    assert "some ranks run other modules" in str(explain_failed_gather(timeout))
    exited = CommError("all_gather of bucket 'gather.0' on rank 0 of 2 (gloo) failed: rank 1 (process 7) exited")
    assert explain_failed_gather(exited) is exited


# -- mixture of experts: leaf modules -----------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 8), nn.Linear(8, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routing: each row goes through the expert its router scores highest, scaled by that probability."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        with torch.no_grad():  # a row whose feature e is largest goes to expert e
            self.router.weight.copy_(2 * torch.eye(EXPERTS, DIM) + 0.01 * torch.randn(EXPERTS, DIM))
        self.used: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, choice = self.router(x).softmax(-1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * gate[rows, None])
        self.used = sorted(set(choice.tolist()))
        return x + out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(DIM, DIM)
        self.moe = MoEBlock()
        self.head = nn.Linear(DIM, 2)
        with torch.no_grad():  # small: each row keeps the feature that routes it
            self.pre.weight.mul_(0.05)
            self.pre.bias.mul_(0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x + self.pre(x))).square().mean()


def _moe_batches(world: int) -> list[torch.Tensor]:
    """A row routed to expert e (``ROUTES``) has a large feature e."""
    out = []
    for step, routes in enumerate(ROUTES):
        x = 0.1 * torch.randn(world * MOE_ROWS, DIM, generator=torch.Generator().manual_seed(100 + step))
        for r in range(world):
            for k, e in enumerate(routes[r]):
                x[r * MOE_ROWS + k, e] += 3.0
        out.append(x)
    return out


def _moe_case(rank: int, world: int, when: str, **zero) -> None:
    torch.manual_seed(0)
    model = MoENet()
    ref = copy.deepcopy(model)
    if when == "before":
        assert zk.set_leaf_modules(model, [MoEBlock]) == [model.moe]
    if when == "config":  # DeepSpeed's zero_optimization.leaf_module, by the block's name
        zero = {**zero, "leaf_module": {"names": ["moe"]}}
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **SMALL, **zero)
    if when == "after":
        zk.set_leaf_modules(model, ["MoEBlock"])
    used, step = [None] * world, iter(ROUTES)

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x)
        if m is model:
            dist.all_gather_object(used, m.moe.used)
            routes = next(step)
            assert used == [sorted(set(routes[r])) for r in range(world)], f"routing is not as planned: {used}"
        return loss

    _train(rank, world, model, ref, opt, _moe_batches(world), f"moe (leaf {when})", forward, MOE_ROWS)


def _control_group_cases(rank: int) -> None:
    """An engine on a non-gloo backend (NCCL) checks its gathers over a new gloo group of the same ranks."""
    engine = TorchCommEngine()
    link = ControlLink(engine)
    assert link.get() is engine
    engine.backend = "nccl"  # what routes the checks off the device; the collectives below run on gloo
    control = link.get()
    assert control is not engine and control.backend == "gloo" and control.group is not engine.group
    assert dist.get_process_group_ranks(control.group) == dist.get_process_group_ranks(engine.group)
    unit = SimpleNamespace(uid=3, numel=8, param_numel=6, name="left", kind="Linear")
    check_same_units(control, [unit], "forward", lambda names: "")
    other = SimpleNamespace(uid=4, numel=8, param_numel=6, name="right", kind="Linear")
    with pytest.raises(CommError, match="rank 1 gathers the parameters of 'right'"):
        check_same_units(control, [unit if rank == 0 else other], "forward", lambda names: "")


def _data_dependent_cases(rank: int, world: int) -> None:
    if world == 2:
        _control_group_cases(rank)
        _divergence_cases(rank, world)
    _moe_case(rank, world, "before", stage3_prefetch_bucket_size=0)
    if world == 2:
        _moe_case(rank, world, "after", stage3_prefetch_bucket_size=400)
        _moe_case(rank, world, "config", stage3_prefetch_bucket_size=0)


@pytest.mark.distributed
@pytest.mark.parametrize("world", (2, 3), ids=lambda w: f"world{w}")
def test_data_dependent_modules_raise_or_train_as_leaf_modules(spawn, world: int) -> None:
    """Ranks gathering different modules raise ``CommError`` on every rank (world 2); a mixture of experts
    whose ranks route to different experts matches AdamW once its block is a leaf module."""
    spawn(_data_dependent_cases, world)


def test_leaf_module_config_marks_by_class_name_and_suffix(caplog: pytest.LogCaptureFixture) -> None:
    """``zero_optimization.leaf_module`` as DeepSpeed applies it: classes by name or qualified name (by default
    Hugging Face's mixture-of-experts blocks), names in ``named_modules()``, name suffixes; an entry of the config's
    own that matches nothing is said."""
    from zero_kernels.stages.stage3 import model_hints

    class Block(nn.Module):  # stands for transformers' Mixtral block (one of DeepSpeed's default leaf classes)
        def __init__(self) -> None:
            super().__init__()
            self.expert = nn.Linear(DIM, DIM)

    Block.__module__, Block.__qualname__ = "transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"
    cases = [
        (None, ["mixtral"]),
        ({"classes": "Expert"}, ["moe.experts.0", "moe.experts.1", "moe.experts.2", "moe.experts.3"][:EXPERTS]),
        ({"classes": [], "names": ["moe"]}, ["moe"]),
        ({"classes": [], "name_suffixes": [".1"]}, ["moe.experts.1"]),
    ]
    for leaf, want in cases:
        model = MoENet()
        model.mixtral = Block()
        zero = {} if leaf is None else {"leaf_module": leaf}
        zk.ShardedFusedAdam(model, lr=LR, stage=3, **zero)
        marked = [name for name, m in model.named_modules() if model_hints.is_leaf(m)]
        assert marked == want, (leaf, marked)
    with caplog.at_level(logging.WARNING, logger="zero_kernels"):
        zk.ShardedFusedAdam(MoENet(), lr=LR, stage=3, leaf_module={"names": ["moe"]})
        assert not caplog.records, "the default classes need not match"
        zk.ShardedFusedAdam(MoENet(), lr=LR, stage=3, leaf_module={"classes": ["Attention"], "names": ["nope"]})
    assert "no module of MoENet matches classes 'Attention', names 'nope'" in caplog.text
    with pytest.raises(ValueError, match="zero_optimization.leaf_module.names=3 is invalid"):
        zk.initialize(MoENet(), {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "leaf_module": {"names": 3}}})  # fmt: skip


def test_set_leaf_modules_bad_input() -> None:
    model = MoENet()
    with pytest.raises(ValueError, match=r"no module of MoENet is one of \['Attention'\]; its classes: \['Expert'"):
        zk.set_leaf_modules(model, ["Attention"])
    with pytest.raises(ValueError, match="non-empty list of nn.Module subclasses or class names"):
        zk.set_leaf_modules(model, [])
    with pytest.raises(ValueError, match="non-empty list"):
        zk.set_leaf_modules(model, [int])
    with pytest.raises(ValueError, match="model must be an nn.Module"):
        zk.set_leaf_modules([model], [MoEBlock])


# -- a parameter used outside its module: the tied output embedding -------------------------------------

VOCAB = 10


class TiedLM(nn.Module):
    """Logits from the input embedding's weight, read in the root's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Linear(DIM, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.embed(tokens[:, :-1])))
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class TiedThroughT(nn.Module):
    """A head tied to the embedding read as ``h @ embed.weight.T`` in the root's forward (``.T`` was taken for a
    read of ``.data``: refused), and a ``ParameterDict`` whose parameters the parent's forward uses (PEFT's
    ``lora_embedding_A``: the dict is never called, so they were found only by use, under the root's name)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix = nn.Embedding(VOCAB, 6), Mixer()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.mix(self.embed(tokens)) @ self.embed.weight.T).square().mean()


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.ParameterDict({"a": nn.Parameter(torch.randn(6, 6)), "b": nn.Parameter(torch.randn(6))})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.table["a"].T + self.table["b"])


def _tied_t_case(rank: int, world: int) -> None:
    records = _Records()
    logging.getLogger("zero_kernels").addHandler(records)
    model, ref = TiedThroughT(), TiedThroughT()
    opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **SMALL)
    _train(rank, world, model, ref, opt, _token_batches(world, 3), "tied through .T, a ParameterDict")
    logging.getLogger("zero_kernels").removeHandler(records)
    text = " ".join(records.messages)
    assert "uses parameter 'embed.weight'" in text and "table" not in text, text


@pytest.mark.distributed
@pytest.mark.parametrize("world", (1, 2), ids=lambda w: f"world{w}")
def test_parameters_read_through_t_and_parameter_dicts(spawn, world: int) -> None:
    spawn(_tied_t_case, world)


def _token_batches(world: int, steps: int) -> list[torch.Tensor]:
    return [
        torch.randint(0, VOCAB, (world * ROWS, 5), generator=torch.Generator().manual_seed(s)) for s in range(steps)
    ]


def _external_cases(rank: int, world: int) -> None:
    records = _Records()
    logging.getLogger("zero_kernels").addHandler(records)
    for registered in (True, False):
        torch.manual_seed(0)
        model = TiedLM()
        ref = copy.deepcopy(model)
        if registered:
            zk.register_external_parameter(model, model.embed.weight)
        opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **SMALL, stage3_prefetch_bucket_size=0)
        _train(rank, world, model, ref, opt, _token_batches(world, 3), f"tied embedding (registered: {registered})")
        found = [m for m in records.messages if "uses parameter 'embed.weight'" in m]
        assert len(found) == (0 if registered else 1), records.messages
        assert "module '<root>' (TiedLM)" in found[0] if found else True
        assert [p is model.embed.weight for p in external_parameters(model)] == [True]
    outside = "outside the forward of its model's modules"
    with pytest.raises(RuntimeError, match=rf"parameter 'embed.weight' is used \(.*\) {outside}"):
        model.embed.weight.square().sum()
    with pytest.raises(RuntimeError, match=rf"parameter 'embed.weight' is used \(p\.T\) {outside}"):
        model.embed.weight.T
    with pytest.raises(RuntimeError, match="gathered_params"):
        torch.cat([model.block.weight, model.block.weight])
    with opt.gathered_params():
        assert model.embed.weight.square().sum() > 0


@pytest.mark.distributed
def test_tied_output_embedding_read_in_root_forward_matches_adamw(spawn) -> None:
    spawn(_external_cases, 2)


def test_register_external_parameter_bad_input() -> None:
    model = TiedLM()
    with pytest.raises(ValueError, match="parameter must be an nn.Parameter, got Tensor"):
        zk.register_external_parameter(model, torch.zeros(2))
    with pytest.raises(ValueError, match="module must be an nn.Module"):
        zk.register_external_parameter("model", model.embed.weight)
    zk.register_external_parameter(model.block, nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match=r"registered on module 'block' \(Linear\) is not a parameter of the model"):
        zk.ShardedFusedAdam(model, stage=3)
    assert all(p.numel() > 0 for p in model.parameters()), "the failed optimizer left the parameters alone"


# -- a module's output that the module did not make -------------------------------------------------------


class Skip(nn.Module):
    """``y + h @ w2`` when ``use``, else ``y`` unchanged, with ``y`` the input ``h`` or (``child``) ``d(h)``."""

    def __init__(self, child: bool) -> None:
        super().__init__()
        self.d = nn.Linear(6, 6) if child else None
        self.w2 = nn.Parameter(torch.randn(6, 6) / 6)

    def forward(self, h: torch.Tensor, use: bool) -> torch.Tensor:
        y = h if self.d is None else self.d(h)
        return y + h @ self.w2 if use else y


class SkipNet(nn.Module):
    """The mean of the losses of ``x``'s chunks, chunk ``k`` run with ``uses[k]``."""

    def __init__(self, child: bool) -> None:
        super().__init__()
        self.inp, self.skip, self.out = nn.Linear(4, 6), Skip(child), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, uses: tuple[bool, ...]) -> torch.Tensor:
        parts = zip(x.chunk(len(uses)), uses)
        losses = [self.out(torch.tanh(self.skip(torch.tanh(self.inp(h)), use))).square().mean() for h, use in parts]
        return sum(losses) / len(uses)


SKIP_USES = ((True, False), (False, True), (False, False), (True, True))  # per step: which ranks use w2


def _skip_forward(ref: nn.Module, rank: int):
    """``forward(m, x)`` for ``_train``: this rank's use of ``w2`` for the model, every rank's for ``ref``, which
    runs after the model in each step."""
    steps = iter(SKIP_USES)
    uses: list[tuple[bool, ...]] = []

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if m is ref:
            return m(x, uses[-1])
        uses.append(next(steps))
        return m(x, uses[-1][rank : rank + 1])

    return forward


def _skip_cases(rank: int, world: int) -> None:
    batches = [torch.randn(world * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    sizes = {
        "small, no prefetch": dict(SMALL, stage3_prefetch_bucket_size=0),
        "small, prefetch 64": dict(SMALL, stage3_prefetch_bucket_size=64),
        "default sizes": dict(stage3_param_persistence_threshold=0),
    }
    for child in (False, True):
        for what, zero in sizes.items():
            torch.manual_seed(0)
            model = SkipNet(child)
            ref = copy.deepcopy(model)
            opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **zero)
            forward = _skip_forward(ref, rank)
            _train(rank, world, model, ref, opt, batches, f"skip (child {child}, {what})", forward)
            opt.pipeline.close()


@pytest.mark.distributed
def test_module_returning_its_input_or_a_child_output_on_some_ranks_matches_adamw(spawn) -> None:
    """A module that adds its parameter's term on some ranks and returns its input (or its child's output)
    unchanged on the others trains as AdamW on the whole batch, with small and default sizes."""
    spawn(_skip_cases, 2)


# -- torch.compile ----------------------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().mean()


def _compiled_cases(rank: int, world: int) -> None:
    batches = [torch.randn(world * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    torch.manual_seed(0)
    model = Small()
    compiled = torch.compile(model, backend="aot_eager")
    for stage in (0, 1, 2, 3):
        ref = copy.deepcopy(model)
        opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=stage, **SMALL)
        step = lambda m, x: (compiled if m is model else m)(x)  # noqa: E731
        _train(rank, world, model, ref, opt, batches, f"compiled stage {stage}", step)
        opt.pipeline.close()


@pytest.mark.distributed
def test_torch_compile_matches_adamw_at_every_stage(spawn) -> None:
    spawn(_compiled_cases, 2)


class Ranks(nn.Module):
    """Modules whose inputs have different ranks (3-D into the convolution and the norm, 2-D into the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv1d(2, 4, 3), nn.LayerNorm(6), nn.Linear(24, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).flatten(1)).square().mean()


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _no_recompiled_hooks_case(rank: int, world: int) -> None:
    torch._logging.set_logs(recompiles=True)
    seen = _Messages()
    logging.getLogger("torch._dynamo").addHandler(seen)
    torch.manual_seed(0)
    model = Ranks()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    compiled = torch.compile(model, backend="eager")
    for _ in range(2):
        compiled(torch.randn(2, 2, 8)).backward()
        opt.step()
        opt.zero_grad()
    ours = [m.splitlines()[0] for m in seen.messages if "zero_kernels" in m]
    assert not ours, f"Dynamo recompiled stage 3's hooks: {ours}"


@pytest.mark.distributed
def test_torch_compile_never_traces_stage3_hooks(spawn) -> None:
    """Under ``torch.compile`` stage 3's module hooks run eagerly and are never traced: traced, they were compiled
    anew for each module class and input rank they served (a small Wav2Vec2 reached Dynamo's recompile limit, with
    its warning on every rank)."""
    spawn(_no_recompiled_hooks_case, 1)


def _compiled_train_step_cases(rank: int, world: int) -> None:
    torch._logging.set_logs(recompiles=True)
    seen = _Messages()
    logging.getLogger("torch._dynamo").addHandler(seen)
    batches = [torch.randn(world * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for stage in (0, 1, 2, 3):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Small()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
        opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=stage, **SMALL)

        @torch.compile(backend="aot_eager")
        def train_step(x: torch.Tensor) -> None:
            model(x).backward()
            opt.step()
            opt.zero_grad()

        for step, x in enumerate(batches):
            train_step(x[rank * ROWS : (rank + 1) * ROWS])
            ref(x).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            with opt.gathered_params():
                _compare(model, ref, f"compiled train_step stage {stage} world {world} step {step}")
        opt.pipeline.close()
    ours = [m.splitlines()[0] for m in seen.messages if "zero_kernels" in m]
    assert not ours, f"Dynamo traced the optimizer's backward hooks: {ours}"


@pytest.mark.distributed
def test_compiled_train_step_matches_adamw_at_every_stage(spawn) -> None:
    """``torch.compile`` of a whole ``train_step`` (forward, ``backward()``, ``step()`` and ``zero_grad()`` inside):
    the backward runs in the compiled frame, whose Dynamo callback used to trace the hooks it calls. Stage 3 raised
    an ``InternalTorchDynamoError`` from its pre-backward gather (a freed parameter's ``_is_view`` taken for a use),
    then from ``zero_grad()``'s ``p.grad = None``; stages 0-2 compiled the gradient hook once per parameter until
    Dynamo's recompile limit, with its warning on every rank."""
    spawn(_compiled_train_step_cases, 2)


class _Adapted(nn.Module):
    """A PEFT-style LoRA layer: it reads its adapter's weight dtype before calling the adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 4, bias=False)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lora_A["default"]
        return self.base(x) + self.lora_B["default"](a(x.to(a.weight.dtype)))


def _square_mean_through(model: nn.Module, run: nn.Module):
    """``_train``'s forward: ``model``'s goes through ``run`` (its compiled form), the reference's as it is."""
    return lambda m, x: (run if m is model else m)(x).square().mean()


def _traced_read_case(rank: int, world: int) -> None:
    seen = _Messages()
    logging.getLogger("zero_kernels").addHandler(seen)
    batches = [torch.randn(world * ROWS, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(_Adapted(), nn.Tanh(), _Adapted())
        ref = copy.deepcopy(model)
        opt = zk.ShardedFusedAdam(model, lr=LR, weight_decay=0.1, stage=3, **SMALL)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        _train(rank, world, model, ref, opt, batches, f"compiled={compiled}", forward=_square_mean_through(model, run))
        said = [m for m in seen.messages if "does not hold" in m]
        assert bool(said) is compiled, said
        assert all("torch.compile, tracing the forward" in m and "lora_A" in m for m in said), said
        opt.pipeline.close()


@pytest.mark.distributed
def test_a_parameter_read_while_compiling_is_said_so(spawn) -> None:
    """A LoRA layer reading its adapter's weight dtype, compiled at stage 3: the tracing wraps the freed weight, which
    is then gathered with the traced module (as training without compile would: the same weights as AdamW), and the
    warning says torch.compile read it, not that the model uses a parameter it does not hold."""
    spawn(_traced_read_case, 2)


class _Reader(nn.Module):
    """A model whose forward reads a parameter of another model, held by another stage-3 optimizer."""

    def __init__(self, other: nn.Module):
        super().__init__()
        self.a = nn.Linear(4, 6)
        object.__setattr__(self, "other", other)  # not a sub-module

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tanh(self.a(z)), self.other[0].weight)


def test_a_model_reading_another_stage3_optimizers_parameter_is_told_so() -> None:
    other = nn.Sequential(nn.Linear(6, 3))
    reader = _Reader(other)
    keep = [zk.ShardedFusedAdam(m, lr=LR, stage=3, stage3_param_persistence_threshold=0) for m in (other, reader)]
    with pytest.raises(RuntimeError, match="parameter '0.weight' .* in the forward of a model that another stage-3"):
        reader(torch.randn(2, 4))
    assert len(keep) == 2


def test_eager_steps_make_no_dynamo_wrappers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks that keep stage 3 out of Dynamo's traces are disabled once: an eager step after the first makes no
    ``torch._dynamo.disable`` wrapper (the graph nodes' hooks, made anew by every forward, made one each: 51 a step
    on a 50-layer MLP, about 10 us each), and trains as AdamW."""
    import torch._dynamo

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
    ref = copy.deepcopy(model)
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, stage3_param_persistence_threshold=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    made = []
    disable = torch._dynamo.disable
    for step in range(3):
        if step == 2:
            monkeypatch.setattr(torch._dynamo, "disable", lambda *a, **k: made.append(a) or disable(*a, **k))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert len(made) <= 1, f"{len(made)} Dynamo wrappers made in one eager step"  # the round's end callback
    with opt.gathered_params():
        _compare(model, ref, "eager stage 3 after the hooks' wrappers")


def test_compiled_autograd_is_refused_naming_it() -> None:
    """Compiled autograd's tracing wraps the freed parameters the backward saved, which it cannot: the error it raises
    has stage 3's own as its cause, naming compiled autograd and the way out (it named a use outside the forward)."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    torch.manual_seed(0)
    model = Small()
    opt = zk.ShardedFusedAdam(model, lr=LR, stage=3, **SMALL)
    compiled = torch.compile(model, backend="aot_eager")
    loss = compiled(torch.randn(ROWS, 4))
    with pytest.raises(Exception) as raised, compiled_autograd._enable(torch.compile(backend="aot_eager")):
        loss.backward()
    chain = [raised.value, raised.value.__cause__]
    assert any("does not support compiled autograd" in str(e) for e in chain), chain
    opt.pipeline.close()

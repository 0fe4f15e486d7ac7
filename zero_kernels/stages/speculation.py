"""SuperOffload (``offload_optimizer.super_offload: true``, stage 3, the state in host memory): the host Adam of a
bucket runs while backward goes on, on a thread of its own, as soon as its reduced gradient shard is complete, on
what the step is expected to decide; the step keeps that update only where everything it read is what the step's
own update of the bucket reads, and otherwise puts the bucket's state back and updates it as without speculation.
So results are those of the run without it, bit for bit, whatever the step decides.

What is guessed (``Guess``), from the optimizer as the backward runs (``Prediction``: only where the next
``step()`` updates): the param group's hyper-parameters; the gradient scale; no clipping and no inf/NaN (the
decision ``outcome.decide`` gives for a finite gradient whose norm does not clip: a multiplier of exactly 1 times
the scale); every parameter of the bucket with a gradient on some rank, at the step counts of now. The step checks
each against its own (``Speculation.settle``, before any update), and that nothing wrote the gradient or parameter
shard the update read since it was handed over (their version counters: every write through torch moves them; the
buffer's gradient shard is expected at its version after its last reduction). A clipped or skipped step, a changed
learning rate, a gradient added by a later backward (accumulation) or set, a parameter edited since: that bucket
is rolled back and updated as without speculation (its update runs twice).

The state is updated in place (a copy of the bucket's state taken first puts it back); the new parameters go to a
copy, which the step copies into the shard (later gathers of the same backward read the shard). Whatever reads or
writes a buffer's state between its speculation and the step goes through the state door (``FlatBuffer.ready``),
which first rolls the buffer's guesses back: state dicts, checkpoints, ``opt.state[p]`` all see the state the step
starts from; ``zero_grad()`` rolls every guess back (its gradients are gone). A state tensor taken from
``opt.state`` before the backward and read after it shows the speculative update; one written then makes the step
raise on every rank (``refusals.STATE_WRITTEN``: neither keeping nor rolling back the update would keep the write as
without speculation). A buffer whose master was written from outside since the last step, or whose state ``ratio``
splits between the device and the host, is not speculated. The copies (below) are taken on the worker, before
the update: what backward's thread does per bucket is to hand it over.

Host memory, kept for reuse from step to step: per bucket a copy of its state (12 bytes per parameter in bf16, 16
with AMSGrad, 8 in fp32) and of its parameters (2 bytes in bf16, 4 in fp32; ``copies``). The updates run one at a
time on one thread of their own, each on torch's intra-op threads as the process has them (the step's own updates
use ``cpuadam_cores_perc`` of the cores: setting that from a second thread would change it under backward's feet).
"""

from __future__ import annotations

import concurrent.futures
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from . import master, outcome, placement, refusals, update
from .buffers import FlatBuffer, GroupHyper
from .layout import Bucket
from .outcome import Decision
from .update import BucketTensors

if TYPE_CHECKING:
    from .base import Pipeline


@dataclass(frozen=True)
class Prediction:
    """What the next step is expected to be: per param group the hyper-parameters, the gradient scale, the clipping
    norm (None: none) and whether it checks for inf/NaN."""

    hyper: list[GroupHyper]
    grad_scale: float
    max_grad_norm: Optional[float]
    check_finite: bool


@dataclass
class Guess:
    """One bucket's speculative update: what it assumed, what it reads and writes (``read``: the gradients, the
    parameters, and the state through aliases), and what the worker keeps (``kept``: each state kind as it was
    before the update, and ``out``, the new parameters; fp32 parameters: also their master)."""

    buf: FlatBuffer
    hyper: GroupHyper
    decision: Decision
    runs: list[tuple[int, int, int]]
    read: dict[str, torch.Tensor]
    params_version: int  # of the parameter shard the update reads
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    future: Optional[concurrent.futures.Future] = None

    def tensors(self) -> BucketTensors:
        """The update's tensors: the state in place, the new parameters into ``kept["out"]``."""
        read, out = self.read, self.kept["out"]
        low = self.buf.master is not None
        return BucketTensors(
            read["master"] if low else out, read["grads"], read["exp_avg"], read["exp_avg_sq"],
            out if low else None, read.get("max_exp_avg_sq"),
        )  # fmt: skip


class Speculation:
    """The guesses of one pipeline (see the module docstring); ``predict`` is set by the optimizer."""

    def __init__(self) -> None:
        self.predict: Callable[[], Optional[Prediction]] = lambda: None
        self.guesses: dict[tuple[int, int], Guess] = {}
        self.ran = self.kept = 0  # buckets updated during backward, and of those kept by the step
        self._versions: dict[int, dict[str, int]] = {}  # id(buffer) -> its state tensors' versions before the guesses
        self._spare: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # per bucket: the copies, kept for reuse
        self._grads_seen: dict[int, int] = {}  # id(buffer) -> its gradient shard's version after the last reduction
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zero_kernels-super-offload")

    # ---------------------------------------------------------------- during backward
    def start(self, pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket) -> None:
        """The reduced gradient shard of ``bucket`` is complete: update its state now, if the next step updates.
        Called after every reduction into the buffer's gradient shard, whose version is then what a guess of the
        buffer expects at the step (a write by anything else moves it)."""
        self._grads_seen[id(buf)] = pipeline.grad_shard(buf, bucket)._version
        if not _eligible(pipeline, buf, bucket):
            return
        prediction = self.predict()
        if prediction is None:
            return
        pipeline.settle()  # the last step's counts, as the step will have them
        if not self._held(buf):
            self._versions[id(buf)] = _versions(buf)
        indices = set(buf.indices)
        guess = _guess(pipeline, buf, bucket, prediction, indices)
        guess.future = self._worker.submit(self._run, pipeline, bucket, guess, indices)
        self.guesses[(id(buf), bucket.index)] = guess
        buf.guessed = _rollback_call(self, buf)
        self.ran += 1

    def _run(self, pipeline: "Pipeline", bucket: Bucket, guess: Guess, indices: set[int]) -> None:
        """On the worker thread: the copies, then the update itself (the kernel releases the GIL)."""
        from .offloaded import host_impl

        spare = self._spare.setdefault((id(guess.buf), bucket.index), {})
        guess.kept = {kind: _copy(spare, kind, t) for kind, t in guess.read.items() if kind in placement.KINDS}
        guess.kept["out"] = _copy(spare, "out", guess.read["params"])
        buf, impl = guess.buf, host_impl(pipeline.impl)
        update.launch(pipeline, buf, bucket, guess.hyper, guess.decision, indices, guess.tensors(), impl=impl)

    def drop(self, pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket) -> None:
        """A new reduction into ``bucket``: its guess, if any, is rolled back first (a state written from outside
        since is refused at the step, on every rank: this runs inside backward, between collectives)."""
        if (id(buf), bucket.index) in self.guesses:
            self._wait(buf)
            if not self._untouched(buf):
                pipeline.refusals.record(refusals.STATE_WRITTEN, buf.indices[0])
            self._undo(self._pop(buf, bucket.index))

    def roll_back(self, buf: Optional[FlatBuffer] = None) -> None:
        """Roll back every guess (of ``buf`` only, when given): the state is what the step starts from."""
        for unit in [buf] if buf is not None else self._buffers():
            self._wait(unit)
            if not self._untouched(unit):
                raise RuntimeError(refusals.state_written(f"{len(unit.params)} parameters"))
            for key in [k for k in self.guesses if k[0] == id(unit)]:
                self._undo(self._pop(unit, key[1]))

    # ---------------------------------------------------------------- at the step
    def settle(self, pipeline: "Pipeline", decision: Decision, hyper: list[GroupHyper], with_grad: set[int]) -> None:
        """Before the step's first update: keep the guesses that hold, roll the others back."""
        for buf in pipeline.buffers:
            if not self._held(buf):
                continue
            self._wait(buf)
            for bucket in buf.layout.buckets:
                guess = self.guesses.get((id(buf), bucket.index))
                if guess is not None and not self._holds(
                    pipeline, bucket, guess, decision, hyper[buf.group], with_grad
                ):
                    self._undo(self._pop(buf, bucket.index))

    def take(self, buf: FlatBuffer, bucket: Bucket, params: torch.Tensor) -> bool:
        """The step's update of ``bucket``: True where its guess held (its new parameters copied into ``params``,
        the host parameters the update writes: for fp32 parameters also their master), False where the step
        updates it itself."""
        if (id(buf), bucket.index) not in self.guesses:
            return False
        params.copy_(self._pop(buf, bucket.index).kept["out"])
        self.kept += 1
        return True

    def copies(self) -> list[torch.Tensor]:
        """The copies kept for reuse (the state before an update, the new parameters): host memory."""
        return [t for spare in self._spare.values() for t in spare.values()]

    def close(self) -> None:
        """The optimizer's end: the updates in flight are waited for, nothing is rolled back."""
        self._worker.shutdown(wait=True)
        self.guesses.clear()

    def _holds(
        self, pipeline: "Pipeline", bucket: Bucket, guess: Guess, decision: Decision, h: GroupHyper, with_grad: set
    ) -> bool:
        """Whether the guess's update ran without an error and the step's own update of ``bucket`` reads what it read
        (then it computes the same): the same hyper-parameters, decision and runs, and no write into the gradient or
        parameter shard since (their versions)."""
        buf = guess.buf
        if guess.future.exception() is not None or h != guess.hyper or not _same_decision(decision, guess.decision):
            return False
        if list(update.runs(pipeline, buf, bucket, with_grad)) != guess.runs:
            return False
        grads, params = pipeline.grad_shard(buf, bucket), pipeline.param_shard(buf, bucket)
        return grads._version == self._grads_seen.get(id(buf)) and params._version == guess.params_version

    # ---------------------------------------------------------------- helpers
    def _pop(self, buf: FlatBuffer, bucket: int) -> Guess:
        """Take the guess of ``buf``'s bucket ``bucket`` out; with its last, the state door stops rolling back."""
        guess = self.guesses.pop((id(buf), bucket))
        if not self._held(buf):
            buf.guessed = None
        return guess

    def _held(self, buf: FlatBuffer) -> bool:
        return any(key[0] == id(buf) for key in self.guesses)

    def _buffers(self) -> list[FlatBuffer]:
        return list({id(g.buf): g.buf for g in self.guesses.values()}.values())

    def _wait(self, buf: FlatBuffer) -> None:
        """Wait for every update of ``buf``'s guesses."""
        concurrent.futures.wait([g.future for k, g in self.guesses.items() if k[0] == id(buf)])

    def _untouched(self, buf: FlatBuffer) -> bool:
        """Whether ``buf``'s state was written since its guesses began only by them (done: ``_wait``): a write from
        outside, not through the state door (a tensor taken from ``opt.state`` before the backward), cannot be kept
        as without speculation, by keeping the updates or by rolling them back."""
        return all(getattr(buf, k)._version == v for k, v in self._versions.get(id(buf), {}).items())

    def written(self, pipeline: "Pipeline") -> Optional[int]:
        """At the step, before its exchange: the optimizer index of a parameter of a buffer whose state was written
        from outside since its guesses began (``refusals.STATE_WRITTEN``: every rank raises), else None."""
        for buf in self._buffers():
            self._wait(buf)
            if not self._untouched(buf):
                return buf.indices[0]
        return None

    @staticmethod
    def _undo(guess: Guess) -> None:
        """Put the state of the guess's bucket back as it was before its update (done: ``_wait``)."""
        for kind in placement.KINDS:
            if kind in guess.kept:
                guess.read[kind].copy_(guess.kept[kind])


def _copy(spare: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into the bucket's spare tensor ``name`` (made on first use, or anew for another size: its pages
    stay, so that later copies do not fault them in again)."""
    kept = spare.get(name)
    if kept is None or kept.shape != t.shape or kept.dtype != t.dtype:
        kept = spare[name] = torch.empty_like(t, memory_format=torch.contiguous_format)
    return kept.copy_(t)


def _versions(buf: FlatBuffer) -> dict[str, int]:
    return {kind: t._version for kind, t in placement.tensors(buf).items()}


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements through a tensor of their own version counter: the guesses' writes (the update, the state
    put back) leave the versions of the buffer's state tensors as they were, so that a move shows a write from
    outside (``Speculation._wait``), and a master written from outside (``master.written``)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


def _eligible(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket) -> bool:
    """Whether the update of ``bucket`` can run now: the host Adam's, on a state in host memory, without a master
    written from outside, a file or an epilogue in its way."""
    tier = pipeline.tier
    return (
        tier is not None
        and tier.kind == "host"
        and placement.in_tier(buf, bucket)
        and placement.resident(buf)
        and not placement.splits(tier, buf)
        and not pipeline.params_in_file(buf)
        and not pipeline.grads_in_file(buf)
        and pipeline.epilogue_quantizer(buf) is None
        and not master.written(buf)
    )


def _guess(pipeline: "Pipeline", buf: FlatBuffer, bucket: Bucket, prediction: Prediction, indices: set[int]) -> Guess:
    """The guess for ``bucket``: what the step is expected to decide, and the views its update reads and writes."""
    from .offloaded import bucket_inputs

    h = prediction.hyper[buf.group]
    params, grads, state = bucket_inputs(pipeline, buf, bucket)
    kinds = [k for k in placement.KINDS if k in state and (k != "max_exp_avg_sq" or h.amsgrad)]
    read = {"grads": grads, "params": params, **{k: _alias(state[k]) for k in kinds}}
    sq = torch.zeros((), dtype=torch.float64) if prediction.max_grad_norm or prediction.check_finite else None
    decision = outcome.decide(sq, prediction.grad_scale, prediction.max_grad_norm, prediction.check_finite)
    runs = list(update.runs(pipeline, buf, bucket, indices))
    return Guess(buf, h, decision, runs, read, pipeline.param_shard(buf, bucket)._version)


def _same_decision(a: Decision, b: Decision) -> bool:
    if (a.skip is None) != (b.skip is None) or (a.skip is not None and not torch.equal(a.skip.cpu(), b.skip)):
        return False
    x, y = a.grad_scale, b.grad_scale
    if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
        return False
    return torch.equal(x.cpu(), y) if isinstance(x, torch.Tensor) else x == y


def _rollback_call(owner: Speculation, buf: FlatBuffer) -> Callable[[], None]:
    """``buf.guessed``: roll its guesses back, both held weakly (the buffer holds this)."""
    me, ref = weakref.ref(owner), weakref.ref(buf)

    def roll_back() -> None:
        spec, unit = me(), ref()
        if spec is not None and unit is not None:
            spec.roll_back(unit)

    return roll_back

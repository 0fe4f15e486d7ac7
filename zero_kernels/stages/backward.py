"""The backward round of a pipeline: gradients reported by their hooks, moved into the stage's buffers,
and reduced bucket by bucket, in the same order on every rank (see ``stages.base`` for the phases).

``BackwardRound`` is the half of ``Pipeline`` that runs during ``loss.backward()``; the pipeline's
constructor sets the state it uses (``where``, ``buffers``, ``has_grad``, the launch order and the
collectives in flight) and the stages override ``_consume_grad``, ``_launch_bucket`` and
``_before_step``. Gradients arrive through ``stages.grad_ready`` (after every hook on the parameter).

Streams (CUDA). Autograd runs the gradient hooks on the forward's stream and the end-of-backward callback, which
completes the round's last reductions, on the stream of the caller of ``backward()``; a step or ``zero_grad()``
completes what is left on the user's. They differ where the forward ran under ``torch.cuda.stream(s)``. A next
backward called from the same stream waits for them (autograd orders its first gradient after the caller's stream),
but the forward before it does not: what the completions free (stage 0's copy in a wider communication dtype, a
scratch bucket the pool does not keep) goes back to the allocator of the hooks' stream, which could hand it to that
forward while they still read it; and a backward called from yet another stream would refill pooled buckets, or add
into ``grad_shard`` and ``p.grad``, before their writes. So the stream current when a round or pass opens is
remembered, and after completions on another stream it waits for them (``_follow_completions``): whatever it queues
next comes after them.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm.handles import Handle
from . import adopt, grad_accum, grad_state, refusals
from .buffers import FlatBuffer, Inflight
from .eager import weakly
from .layout import Bucket


class BackwardRound:
    """The backward half of ``Pipeline`` (a base class of it; see the module docstring)."""

    @property
    def sync_enabled(self) -> bool:
        """Whether a backward reduces its gradients (False under ``no_sync`` and on accumulation micro-steps)."""
        return self._sync_enabled

    @sync_enabled.setter
    def sync_enabled(self, value: bool) -> None:
        """Turned off after a synchronised backward of this step (``no_sync`` entered then), what the next backward
        passes leave in ``p.grad`` is owed one more round of reduction, at the step unless a synchronised backward
        comes first; every rank owes it, the ``no_sync`` pattern being the same on every rank."""
        if self._sync_enabled and not value and self._synced:
            self._owed = True
            self._grads_final = False
        self._sync_enabled = value

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        self._check_dense(p)
        self.window_open = True
        self.grad_arrivals += 1
        b, slot = self.where[id(p)]
        buf = self.buffers[b]
        index = buf.index_of(slot)
        self.has_grad[index] = True
        self._note_arrival(index)
        self._note_gradient(index, p)
        if not self.sync_enabled:
            self._open_pass()
            if buf.grad_flat is not None:  # stages 0-1: p.grad views grad_flat (or wide_local: added into it)
                self._consume_grad(buf, slot, p)
            return
        first = self._first_report(b, slot, p)
        if first is None:
            self._drop_grad(buf, slot, p)
            return
        if not first:
            self._add_grad(buf, slot, p)
            return
        self._consume_grad(buf, slot, p)
        for k in buf.layout.slot_buckets[slot]:
            buf.pending[k] -= 1
        self._launch_ready()

    def _note_arrival(self, index: int) -> None:
        """Count a parameter's gradients between ``step()`` calls (the optimizer warns where several backward
        passes reach each call while it counts the calls as accumulation micro-steps)."""
        if index in self.since_step_call:
            self.repeated_since_step_call = True
        self.since_step_call.add(index)

    def step_called(self) -> bool:
        """Whether a parameter got several gradients since the last ``step()`` call; starts counting again."""
        repeated = self.repeated_since_step_call
        self.since_step_call.clear()
        self.repeated_since_step_call = False
        return repeated

    def _first_report(self, b: int, slot: int, p: torch.Tensor) -> Optional[bool]:
        """Open the round if needed; False when ``p`` already reported in it, None when it cannot be taken.

        A parameter used in several segments of reentrant activation checkpointing
        (``torch.utils.checkpoint(..., use_reentrant=True)``) gets its gradient once per segment,
        each a backward of its own. A repeated gradient is added to the first while the parameter's
        buckets wait; once one of them has been reduced it cannot be: refused (``refusals``: whether
        the bucket was reduced already depends on this rank's data, so every rank raises at the step).
        """
        if not self._round_open:
            self._round_open = True
            self._hook_stream = self._cuda_stream()
            self._queue_round_end()
        if (b, slot) not in self._reported:
            self._reported.add((b, slot))
            return True
        launched = set(self._launch_order[: self._next_launch])
        if self.reduces_in_backward and any((b, k) in launched for k in self.buffers[b].layout.slot_buckets[slot]):
            buf = self.buffers[b]
            self._refuse(refusals.SECOND_GRADIENT, buf.index_of(slot), p)
            return None
        return False

    def _open_pass(self) -> None:
        """A backward that reduces nothing (``no_sync``, a stage 0-1 micro-step) opens no round; it is marked open
        until it ends, so that one that raised is told apart (``failed_round_open``) as a round is: ``zero_grad()``
        then drops the window, where it would take the failure's gradients for a backward after the step."""
        if not self._pass_open:
            self._pass_open = True
            self._hook_stream = self._cuda_stream()
            torch.autograd.Variable._execution_engine.queue_callback(weakly(self._end_pass))  # eager, held weakly

    def _end_pass(self) -> None:
        self._pass_open = False

    def _queue_round_end(self) -> None:
        """The round ends with the backward running now (an autograd callback); stage 3 ends it with the backward its
        scheduler follows instead."""
        torch.autograd.Variable._execution_engine.queue_callback(weakly(self._end_round))  # eager, held weakly

    def _refuse(self, kind: int, index: int, p: torch.Tensor) -> None:
        """Problem ``kind`` with parameter ``p`` (optimizer index ``index``): raised now on one rank, else recorded
        and raised by the step on every rank (``refusals``)."""
        if self.world_size == 1:
            raise RuntimeError(refusals.describe(kind, self.stage, self.name_of(p)))
        self.refusals.record(kind, index)

    def _note_gradient(self, index: int, p: torch.Tensor) -> None:
        """A gradient arrives: one after ``finish_grad_sync`` makes the step finish again, one after
        ``clip_grad_norm_`` is refused, and so is one of an unscaled backward under fp16 loss scaling, at the
        step (``refusals``)."""
        self._grads_final = False
        if self.clipped:
            self._refuse(refusals.AFTER_CLIP, index, p)
        if self.loss_scaled and not self.scaled_backward:
            self.refusals.record(refusals.UNSCALED_BACKWARD, index)

    def _drop_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """A gradient refused (``_first_report``): the step raises; default (stage 0): it stays in ``p.grad``."""

    def _add_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """A repeated gradient of ``p`` in this round, its buckets not yet reduced (``_first_report``).

        Default (stages 0 and 1): ``p.grad`` views ``grad_flat`` and autograd added to it in place, or
        replaced it by the sum: ``_consume_grad`` keeps the sum."""
        self._consume_grad(buf, slot, p)

    def _check_dense(self, p: torch.Tensor) -> None:
        if p.grad.layout != torch.strided:
            b, slot = self.where[id(p)]
            index = self.buffers[b].index_of(slot)
            raise RuntimeError(
                "ShardedFusedAdam does not support sparse gradients, please consider SparseAdam instead "
                f"(parameter {index}, shape {tuple(p.shape)}, has a {p.grad.layout} gradient)"
            )

    def _consume_grad(self, buf: FlatBuffer, slot: int, p: torch.Tensor) -> None:
        """Default (stages 0 and 1): make ``p.grad`` a view of ``grad_flat`` holding its value; with a wider
        ``grad_accum_dtype`` (``wide_local``) add it into ``grad_flat`` and drop it (``grad_accum.add_local``)."""
        s = buf.layout.slots[slot]
        if p.grad.shape != s.shape or (s.numel and p.dtype != buf.dtype):  # p.data resized or cast since build
            adopt.check_compatible(buf, p, s.shape, self.name_of)
        if self.wide_local:
            grad_accum.add_local(self, buf, slot, p)
            return
        view = buf.grad_flat.narrow(0, s.offset, s.numel).view(s.shape)
        if p.grad is not view and (p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape):
            view.copy_(p.grad)
            p.grad = view

    def _launch_ready(self, flush: bool = False) -> None:
        while self._next_launch < len(self._launch_order):
            b, k = self._launch_order[self._next_launch]
            buf = self.buffers[b]
            if buf.pending[k] > 0 and not flush:
                return
            if buf.pending[k] > 0:
                self._take_unreported(b, buf.layout.buckets[k])
                grad_state.zero_dropped_grads(self, buf, buf.layout.buckets[k])
            self._launch_bucket(buf, buf.layout.buckets[k])
            self._next_launch += 1
            # with super_offload the updates run during backward start as each reduction ends
            self._complete_inflight(keep=self.max_inflight, finished=self.speculation is not None)

    def _take_unreported(self, b: int, bucket: Bucket) -> None:
        """Before ``bucket`` is reduced at the end of a round: gradients in ``p.grad`` of parameters that did not
        report in it (an earlier backward under ``no_sync`` gave them one, this one none) join it."""
        buf = self.buffers[b]
        for slot in bucket.slots:
            p = buf.param_of(slot)
            if p.grad is not None and (b, slot) not in self._reported:
                self._check_dense(p)
                self._reported.add((b, slot))
                self._consume_grad(buf, slot, p)

    def _launch_bucket(self, buf: FlatBuffer, bucket: Bucket) -> None:
        """Start reducing ``bucket``'s gradients (``self._track`` the collective); default: at the step."""

    def _end_round(self) -> None:
        self._launch_ready(flush=True)
        self._complete_inflight()  # a next backward accumulates into p.grad: stage 0 reduces it in place
        self._synced = True
        self._owed = False  # the round took every gradient in p.grad
        self._reset_round()

    def _reset_round(self) -> None:
        """Ready for the next round. The round is marked closed last, in one statement with the launch position: an
        interrupt in between (Ctrl-C caught by the loop, at the end of a backward) leaves it open, so that
        ``zero_grad()`` or the step ends it again (``_close_failed_round``), where a round marked closed with
        counts half reset made the next backward reduce buckets before their gradients arrived."""
        for buf in self.buffers:
            self._reset_pending(buf)
        self._reported.clear()
        self._next_launch, self._round_open = 0, False

    def _close_failed_round(self, keep: bool) -> None:
        """End the round a backward that raised left open: autograd drops the end-of-backward callback then, and
        no backward runs at the step or ``zero_grad()``, so a round still open there is such a one.

        ``keep`` (the step, ``clip_grad_norm_``): end it as backward would have; its gradients are the step's, as
        ``torch.optim.AdamW`` uses what the failed backward left in ``p.grad``. Else (``zero_grad()``): complete the
        collectives it launched, in issue order (ranks whose backward raised at the same point launched the same
        ones), drop the gradients it left in the stage's buffers, and let the next backward open a new round. A
        failed pass that reduced nothing (``_open_pass``) left its gradients where the step or ``zero_grad()`` finds
        them."""
        self._pass_open = False
        if not self._round_open:
            return
        if keep:
            self._end_round()
            return
        self._complete_inflight()
        self.engine.synchronize()  # one whose handle an interrupt lost on its way back (Ctrl-C after the issue)
        for buf in self.buffers:
            self._drop_unreduced(buf)
        self._reset_round()

    def _drop_unreduced(self, buf: FlatBuffer) -> None:
        """Drop the gradients an abandoned round left in ``buf`` unreduced (``_close_failed_round``); default
        (stages 0-1): they are in ``grad_flat``, which ``zero_grad`` zeroes."""

    def _reset_pending(self, buf: FlatBuffer) -> None:
        buf.pending = [sum(1 for _ in k.slots) for k in buf.layout.buckets]

    def _sync_manual_grads(self) -> None:
        """A synchronisation round at the step for gradients no hook consumed (set by hand, or no_sync); a gradient
        of another size than its parameter is refused first, naming it."""
        for buf in self.buffers:
            for slot in buf.layout.slots:
                p = buf.params[slot.param]
                if p.grad is not None and p.grad.numel() != slot.numel:
                    raise ValueError(
                        f"{self.name_of(p)} has a gradient of {p.grad.numel()} elements where it has {slot.numel} "
                        "(set by hand: at stage 3 a parameter between uses reports shape (0,)): set gradients by hand "
                        "inside opt.gathered_params(), where parameters have their full shapes, or let backward make "
                        "them; nothing was updated"
                    )
        for buf in self.buffers:
            for slot_index, slot in enumerate(buf.layout.slots):
                p = buf.params[slot.param]
                if p.grad is not None:
                    self._check_dense(p)
                    self.has_grad[buf.index_of(slot)] = True
                    self._consume_grad(buf, slot_index, p)
        self._end_round()

    def _track(self, handle: Optional[Handle], epilogue: Optional[Callable[[], None]] = None, held: tuple = ()) -> None:
        """Remember a collective just issued (None: nothing was issued) until it is completed."""
        if handle is not None:
            self._inflight.append(Inflight(handle, epilogue, held))

    def _complete_inflight(self, keep: int = 0, finished: bool = False) -> None:
        """Complete the oldest collectives, in issue order, until at most ``keep`` are in flight; with ``finished``,
        then also those that have finished (without waiting for any)."""
        completed = False
        while self._inflight and (len(self._inflight) > keep or finished and self._inflight[0].handle.is_completed()):
            op = self._inflight.pop(0)
            op.handle.wait()
            if op.epilogue is not None:
                op.epilogue()
            completed = True
        if completed:
            self._follow_completions()

    def _cuda_stream(self) -> Optional["torch.cuda.Stream"]:
        """The current stream of the parameters' device where that is a GPU, else None."""
        device = self.device
        return torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None

    def _follow_completions(self) -> None:
        """After completions on the current stream: where the last round's or pass's hooks ran on another one, that
        one waits for them (see the module docstring), on the device, without the host waiting."""
        hooks = self._hook_stream
        if hooks is None:
            return
        current = torch.cuda.current_stream(hooks.device)
        if current != hooks:
            hooks.wait_stream(current)

    def _before_step(self) -> None:
        """Finish the reduction of gradients into ``grad_shard`` (stage 1 reduces here)."""

"""Adam/AdamW on a flat shard in one Triton launch (two with a found-inf flag).

The update reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq once:
28 bytes per parameter with an fp32 gradient (24 with bf16/fp16), plus the optional low-precision
copy. With ``found_inf`` a first kernel reads the gradient once more and ORs "some element is not
finite" into the flag; every program of the update kernel then loads the flag and, when it is set,
returns before touching memory, so no host synchronisation is needed anywhere. ``skip_if`` (a flag
decided elsewhere, e.g. over every rank) is read the same way, without the first kernel. Loads and stores
are vectorised when the shard size is a multiple of 16 and its tensors are 16-byte aligned (Triton
specialises on both): pad shards, and launch a piece of a shard that starts or ends off a 16-element
boundary over the aligned span around it, the piece given as ``window`` (its other elements are
stored back as they were read), so that every launch runs the same compiled vector variant.

Variants are ``tl.constexpr`` flags of the one update kernel; a flag that is off compiles to
nothing, so the default path runs the same instructions. Besides ``ADAMW``, ``SCALE_MODE``,
``HAS_FOUND_INF`` and ``HAS_OUT``: ``AMSGRAD`` (a fifth fp32 stream, the running maximum of
``exp_avg_sq``, which the denominator then uses: 36 bytes per parameter), ``MAXIMIZE`` (the
scaled gradient is negated first) and ``WINDOW`` (``window=``: the blocks that hold elements
outside the window reload those elements and store them back, the others run as without it; the
pipeline passes a window with every launch, so it compiles this one variant, at its first step) and
``ADOPT_OUT`` (``out`` is read first and its edits reach the fp32 params: one more low-precision read
per element).

Hyper-parameters are runtime scalars (an lr schedule never recompiles); the bias corrections and
``1 - beta`` factors are computed on the host in float64, as ``torch.optim.AdamW`` does. Math is
fp32 with IEEE-rounded division and square root. Tensors must be on a CUDA device, or on the CPU
when Triton runs in interpreter mode (``TRITON_INTERPRET=1`` set before import).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from . import tuning
from .reference import SCALE_FLOAT, SCALE_TENSOR, Scale, adam_scalars, check_adam_args, check_window, scale_kind
from .triton_flatten import cast_rne

_LOW_PRECISION_OUT = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["lo", "hi"])
def _nonfinite_kernel(
    grad_ptr,  # gradient, fp32/bf16/fp16, read only
    found_inf_ptr,  # one-element fp32 flag, set to 1 when this block holds a nan or an inf
    n_elements,
    lo,  # only elements [lo, hi) count
    hi,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(grad_ptr + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
    bad = ((g != g) | (tl.abs(g) == float("inf"))) & (offs >= lo) & (offs < hi)
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        tl.store(found_inf_ptr, 1.0)


@triton.jit
def _put(ptr, offs, mask, value, lo, hi, edge, WINDOW: tl.constexpr):
    """Store ``value``; with ``WINDOW``, in a block that holds elements outside ``[lo, hi)`` (``edge``), those
    keep what ``ptr`` holds (a select, not a store mask: the store stays vectorised)."""
    if WINDOW:
        if edge:
            value = tl.where((offs >= lo) & (offs < hi), value, tl.load(ptr + offs, mask=mask))
    tl.store(ptr + offs, value, mask=mask)


@triton.jit(do_not_specialize=["lo", "hi"])
def _adam_kernel(
    # pointers
    param_ptr,  # fp32 master params, updated in place
    grad_ptr,  # gradient, fp32/bf16/fp16 (the dtype comes from the pointer), read only
    exp_avg_ptr,  # fp32 first moment, updated in place
    exp_avg_sq_ptr,  # fp32 second moment, updated in place
    out_ptr,  # copy of the updated params in out's dtype (written when HAS_OUT)
    grad_scale_ptr,  # one-element fp32 gradient multiplier (read when SCALE_MODE == 2)
    found_inf_ptr,  # one-element fp32 flag; non-zero means write nothing (read when HAS_FOUND_INF)
    max_exp_avg_sq_ptr,  # fp32 running maximum of the second moment, updated in place (when AMSGRAD)
    # sizes
    n_elements,
    lo,  # with WINDOW, elements [lo, hi) are updated; the others are stored back as they were
    hi,
    # runtime hyper-parameters (fp32 scalars)
    decay,  # 1 - lr * weight_decay (AdamW)
    weight_decay,  # L2 coefficient added to the gradient (Adam)
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,  # lr / (1 - beta1**step)
    bc2_sqrt,  # sqrt(1 - beta2**step)
    grad_scale,  # gradient multiplier (used when SCALE_MODE == 1)
    # meta-parameters
    ADAMW: tl.constexpr,
    SCALE_MODE: tl.constexpr,  # 0 none, 1 scalar argument, 2 one-element tensor
    HAS_FOUND_INF: tl.constexpr,
    HAS_OUT: tl.constexpr,
    AMSGRAD: tl.constexpr,  # normalise by the running maximum of the second moment
    MAXIMIZE: tl.constexpr,  # ascend: negate the scaled gradient
    WINDOW: tl.constexpr,  # update [lo, hi) only (a piece launched on the aligned span around it)
    ADOPT_OUT: tl.constexpr,  # read out first: the fp32 params take its edits
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:
            return
    mask = offs < n_elements

    p = tl.load(param_ptr + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(exp_avg_ptr + offs, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask)
    if ADOPT_OUT:  # where out is not p rounded to its dtype (bit for bit), p takes its value
        o = tl.load(out_ptr + offs, mask=mask)
        mine = cast_rne(p, out_ptr.dtype.element_ty)
        if out_ptr.dtype.element_ty == tl.float32:
            edited = o.to(tl.uint32, bitcast=True) != mine.to(tl.uint32, bitcast=True)
        else:
            edited = o.to(tl.uint16, bitcast=True) != mine.to(tl.uint16, bitcast=True)
        p = tl.where(edited, o.to(tl.float32), p)

    if SCALE_MODE == 1:
        g = g * grad_scale
    if SCALE_MODE == 2:
        g = g * tl.load(grad_scale_ptr)
    if MAXIMIZE:
        g = -g
    if ADAMW:
        p = p * decay
    else:
        g = g + weight_decay * p
    m = m * beta1 + one_minus_beta1 * g
    v = v * beta2 + one_minus_beta2 * (g * g)
    edge = (pid * BLOCK < lo) | (pid * BLOCK + BLOCK > hi)  # read only with WINDOW
    if AMSGRAD:
        v_max = tl.maximum(tl.load(max_exp_avg_sq_ptr + offs, mask=mask), v, propagate_nan=tl.PropagateNan.ALL)
        _put(max_exp_avg_sq_ptr, offs, mask, v_max, lo, hi, edge, WINDOW)
        denom = tl.div_rn(tl.sqrt_rn(v_max), bc2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)

    _put(param_ptr, offs, mask, p, lo, hi, edge, WINDOW)
    _put(exp_avg_ptr, offs, mask, m, lo, hi, edge, WINDOW)
    _put(exp_avg_sq_ptr, offs, mask, v, lo, hi, edge, WINDOW)
    if HAS_OUT:
        _put(out_ptr, offs, mask, cast_rne(p, out_ptr.dtype.element_ty), lo, hi, edge, WINDOW)


INTERPRETED: bool = isinstance(_adam_kernel, InterpretedFunction)


def adam_step_triton(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adamw: bool = True,
    grad_scale: Scale = None,
    found_inf: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    max_exp_avg_sq: Optional[torch.Tensor] = None,
    maximize: bool = False,
    skip_if: Optional[torch.Tensor] = None,
    window: Optional[tuple[int, int]] = None,
    adopt_out: bool = False,
) -> None:
    """``reference.adam_step_ref`` as one fused Triton launch; same arguments, same results.

    A ``window`` does not narrow the launch: it covers every element (so an aligned span launches the
    vector variant, whatever the window) and updates those of the window only.
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, found_inf, out, max_exp_avg_sq, skip_if)
    lo, hi = check_window(window, param.numel())
    scale_mode = scale_kind("adam_step: grad_scale", grad_scale, param.device)
    if out is not None and out.dtype not in _LOW_PRECISION_OUT:
        raise ValueError(f"adam_step: out dtype {out.dtype}; allowed: float32, bfloat16, float16")
    step_size, bc2_sqrt = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, step=step)
    n = param.numel()
    if lo == hi:
        return
    flag = found_inf if found_inf is not None else skip_if  # the update kernel reads either the same way
    with tuning.launch_device(param):
        if found_inf is not None:
            check = tuning.pick(tuning.NONFINITE, n)
            _nonfinite_kernel[(triton.cdiv(n, check.block),)](
                grad, found_inf, n, lo, hi, BLOCK=check.block, num_warps=check.num_warps
            )
        config = tuning.pick(tuning.ADAM, n)
        _adam_kernel[(triton.cdiv(n, config.block),)](
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            out if out is not None else param,
            grad_scale if scale_mode == SCALE_TENSOR else param,
            flag if flag is not None else param,
            max_exp_avg_sq if max_exp_avg_sq is not None else param,
            n,
            lo,
            hi,
            float(1.0 - lr * weight_decay),
            float(weight_decay),
            float(beta1),
            float(1.0 - beta1),
            float(beta2),
            float(1.0 - beta2),
            float(eps),
            float(step_size),
            float(bc2_sqrt),
            float(grad_scale) if scale_mode == SCALE_FLOAT else 1.0,
            ADAMW=bool(adamw),
            SCALE_MODE=scale_mode,
            HAS_FOUND_INF=flag is not None,
            HAS_OUT=out is not None,
            AMSGRAD=max_exp_avg_sq is not None,
            MAXIMIZE=bool(maximize),
            WINDOW=window is not None,
            ADOPT_OUT=bool(adopt_out) and out is not None,
            BLOCK=config.block,
            num_warps=config.num_warps,
        )

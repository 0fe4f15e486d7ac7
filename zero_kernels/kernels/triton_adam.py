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

The epilogue (``quantized=``, ZeRO++'s int8 weights) is a second kernel, ``_adam_quantize_kernel``, with
the same update (the same jit helpers, the same flags but ``WINDOW``) laid out differently: one program
per quantization block of ``quantized`` (a power-of-two tile masked past the block, which may be any
size; ``quantized_gather.Payload`` picks an even one of at most 2048, a multiple of 4), so the program
holds the whole block it just wrote and quantizes it before it ends (``triton_quant.quantize_int8_tile``:
the block's absmax, the scale, the integers): one extra byte written per element and 4 per block, no
second read of the parameters. A skipped step (the flag set) quantizes the parameters as they are.

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
from .quant_reference import QuantizedBlocks
from .reference import (
    SCALE_FLOAT,
    SCALE_TENSOR,
    Scale,
    adam_scalars,
    check_adam_args,
    check_quantized,
    check_window,
    scale_kind,
)
from .triton_flatten import cast_rne
from .triton_quant import block_launch_meta, block_tile, quantize_int8_tile

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


@triton.jit
def _adopted(p, out_ptr, offs, mask):
    """``p``, or ``out``'s value where ``out`` is not ``p`` rounded to its dtype, bit for bit (edited since)."""
    o = tl.load(out_ptr + offs, mask=mask)
    mine = cast_rne(p, out_ptr.dtype.element_ty)
    if out_ptr.dtype.element_ty == tl.float32:
        edited = o.to(tl.uint32, bitcast=True) != mine.to(tl.uint32, bitcast=True)
    else:
        edited = o.to(tl.uint16, bitcast=True) != mine.to(tl.uint16, bitcast=True)
    return tl.where(edited, o.to(tl.float32), p)


@triton.jit
def _moments(
    p,
    g,
    m,
    v,
    grad_scale_ptr,
    grad_scale,
    decay,
    weight_decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    ADAMW: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    MAXIMIZE: tl.constexpr,
):
    """The gradient scaled (and negated to ascend), the decay applied; returns the new (p, m, v)."""
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
    v = v * beta2 + (one_minus_beta2 * g) * g  # torch's addcmul order: g * g overflows for |g| > 1.8e19
    return p, m, v


@triton.jit
def _descend(p, m, second, eps, step_size, bc2_sqrt):
    """``p`` moved by ``step_size * m / (sqrt(second) / bc2_sqrt + eps)``, IEEE-rounded."""
    denom = tl.div_rn(tl.sqrt_rn(second), bc2_sqrt) + eps
    return p - step_size * tl.div_rn(m, denom)


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
        p = _adopted(p, out_ptr, offs, mask)
    p, m, v = _moments(
        p, g, m, v, grad_scale_ptr, grad_scale, decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
        ADAMW, SCALE_MODE, MAXIMIZE,
    )  # fmt: skip
    edge = (pid * BLOCK < lo) | (pid * BLOCK + BLOCK > hi)  # read only with WINDOW
    if AMSGRAD:
        v_max = tl.maximum(tl.load(max_exp_avg_sq_ptr + offs, mask=mask), v, propagate_nan=tl.PropagateNan.ALL)
        _put(max_exp_avg_sq_ptr, offs, mask, v_max, lo, hi, edge, WINDOW)
        p = _descend(p, m, v_max, eps, step_size, bc2_sqrt)
    else:
        p = _descend(p, m, v, eps, step_size, bc2_sqrt)

    _put(param_ptr, offs, mask, p, lo, hi, edge, WINDOW)
    _put(exp_avg_ptr, offs, mask, m, lo, hi, edge, WINDOW)
    _put(exp_avg_sq_ptr, offs, mask, v, lo, hi, edge, WINDOW)
    if HAS_OUT:
        _put(out_ptr, offs, mask, cast_rne(p, out_ptr.dtype.element_ty), lo, hi, edge, WINDOW)


@triton.jit
def _adam_quantize_kernel(
    # pointers: those of _adam_kernel, then the epilogue's
    param_ptr,  # fp32 master params, updated in place
    grad_ptr,  # gradient, fp32/bf16/fp16, read only
    exp_avg_ptr,  # fp32 first moment, updated in place
    exp_avg_sq_ptr,  # fp32 second moment, updated in place
    out_ptr,  # the written params: the copy in out's dtype when HAS_OUT, else param_ptr itself
    grad_scale_ptr,  # one-element fp32 gradient multiplier (read when SCALE_MODE == 2)
    found_inf_ptr,  # one-element fp32 flag; non-zero: no update, the blocks of the params as they are
    max_exp_avg_sq_ptr,  # fp32 running maximum of the second moment (when AMSGRAD)
    data_ptr,  # uint8 out: the int8 values of the written params, block by block (num_blocks * block bytes)
    scales_ptr,  # fp32 out: one scale per block
    # sizes
    n_elements,
    block,  # elements per quantization block: one program each
    # runtime hyper-parameters, as _adam_kernel's
    decay,
    weight_decay,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,
    bc2_sqrt,
    grad_scale,
    # meta-parameters, as _adam_kernel's
    ADAMW: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_OUT: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    ADOPT_OUT: tl.constexpr,
    ALIGN: tl.constexpr,  # a power of two dividing block
    TILE: tl.constexpr,  # a power of two >= block
):
    b, _, offs, in_block = block_tile(block, ALIGN, TILE)
    mask = in_block & (offs < n_elements)
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0.0:  # skipped: the blocks of the params as they are
            x = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            quantize_int8_tile(x, data_ptr, scales_ptr, b, offs, in_block)
            return

    p = tl.load(param_ptr + offs, mask=mask)
    g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(exp_avg_ptr + offs, mask=mask)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask)
    if ADOPT_OUT:
        p = _adopted(p, out_ptr, offs, mask)
    p, m, v = _moments(
        p, g, m, v, grad_scale_ptr, grad_scale, decay, weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
        ADAMW, SCALE_MODE, MAXIMIZE,
    )  # fmt: skip
    if AMSGRAD:
        v_max = tl.maximum(tl.load(max_exp_avg_sq_ptr + offs, mask=mask), v, propagate_nan=tl.PropagateNan.ALL)
        tl.store(max_exp_avg_sq_ptr + offs, v_max, mask=mask)
        p = _descend(p, m, v_max, eps, step_size, bc2_sqrt)
    else:
        p = _descend(p, m, v, eps, step_size, bc2_sqrt)
    tl.store(param_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, m, mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
    if HAS_OUT:
        low = cast_rne(p, out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, low, mask=mask)
        x = low.to(tl.float32)
    else:
        x = p
    quantize_int8_tile(tl.where(mask, x, 0.0), data_ptr, scales_ptr, b, offs, in_block)


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
    quantized: Optional[QuantizedBlocks] = None,
) -> None:
    """``reference.adam_step_ref`` as one fused Triton launch; same arguments, same results.

    A ``window`` does not narrow the launch: it covers every element (so an aligned span launches the
    vector variant, whatever the window) and updates those of the window only. With ``quantized`` the
    update kernel is ``_adam_quantize_kernel``: one program per quantization block, which updates the block
    and quantizes what it wrote.
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, found_inf, out, max_exp_avg_sq, skip_if)
    check_quantized(quantized, param, window)
    lo, hi = check_window(window, param.numel())
    scale_mode = scale_kind("adam_step: grad_scale", grad_scale, param.device)
    if out is not None and out.dtype not in _LOW_PRECISION_OUT:
        raise ValueError(f"adam_step: out dtype {out.dtype}; allowed: float32, bfloat16, float16")
    step_size, bc2_sqrt = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, step=step)
    n = param.numel()
    if lo == hi:
        return
    flag = found_inf if found_inf is not None else skip_if  # the update kernel reads either the same way
    pointers = (
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        out if out is not None else param,
        grad_scale if scale_mode == SCALE_TENSOR else param,
        flag if flag is not None else param,
        max_exp_avg_sq if max_exp_avg_sq is not None else param,
    )
    scalars = (
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
    )
    flags = {
        "ADAMW": bool(adamw),
        "SCALE_MODE": scale_mode,
        "HAS_FOUND_INF": flag is not None,
        "HAS_OUT": out is not None,
        "AMSGRAD": max_exp_avg_sq is not None,
        "MAXIMIZE": bool(maximize),
        "ADOPT_OUT": bool(adopt_out) and out is not None,
    }
    with tuning.launch_device(param):
        if found_inf is not None:
            check = tuning.pick(tuning.NONFINITE, n)
            _nonfinite_kernel[(triton.cdiv(n, check.block),)](
                grad,
                found_inf,
                n,
                lo,
                hi,
                BLOCK=check.block,
                num_warps=check.num_warps,
                enable_fp_fusion=tuning.FP_FUSION,
            )
        if quantized is not None:
            q = quantized
            _adam_quantize_kernel[(q.num_blocks,)](
                *pointers, q.data, q.scales, n, q.block, *scalars, **flags, **epilogue_meta(q.block)
            )
            return
        config = tuning.pick(tuning.ADAM, n)
        _adam_kernel[(triton.cdiv(n, config.block),)](
            *pointers,
            n,
            lo,
            hi,
            *scalars,
            **flags,
            WINDOW=window is not None,
            BLOCK=config.block,
            num_warps=config.num_warps,
            enable_fp_fusion=tuning.FP_FUSION,
        )


def epilogue_meta(block: int) -> dict[str, int]:
    """The fused kernel's tile for quantization blocks of ``block`` elements: the next power of two, with 8
    elements per thread (as the plain kernel's 2048-element blocks on 8 warps) up to 8 warps."""
    return block_launch_meta(block, 256)

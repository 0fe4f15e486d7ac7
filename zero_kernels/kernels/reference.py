"""Pure-PyTorch twins of the fused kernels: the test oracle and the fallback path.

Every backend (Triton, C++ CPU) implements exactly these signatures and this math. Math is fp32
whatever the storage dtype; bias corrections are computed on the host in float64.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from .quant_reference import QuantizedBlocks, check_buffers, quantize_ref

Scale = Union[float, torch.Tensor, None]
SCALE_NONE, SCALE_FLOAT, SCALE_TENSOR = 0, 1, 2  # what a Scale is (the Triton kernels branch on it)


def scale_kind(what: str, scale: Scale, device: Optional[torch.device] = None) -> int:
    """Which ``SCALE_*`` ``scale`` is: None, a Python number, or a one-element float32 tensor (on ``device``
    when given, as the Triton kernels read it there); ValueError naming ``what`` for anything else."""
    if scale is None:
        return SCALE_NONE
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or (device is not None and scale.device != device):
            on = "" if device is None else f" on {device}"
            got = f"{scale.numel()} element(s) of {scale.dtype}" + ("" if device is None else f" on {scale.device}")
            raise ValueError(f"{what} must be a float or a one-element float32 tensor{on}, got {got}")
        return SCALE_TENSOR
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return SCALE_FLOAT
    raise ValueError(f"{what} must be None, a float or a one-element tensor, got {type(scale)}")


def adam_scalars(*, lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step_size, sqrt(bias_correction2)) in float64, as ``torch.optim.AdamW`` computes them."""
    if step < 1:
        raise ValueError(f"adam step must be >= 1, got {step}")
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    return lr / bias_correction1, math.sqrt(bias_correction2)


def check_adam_args(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    found_inf: Optional[torch.Tensor],
    out: Optional[torch.Tensor],
    max_exp_avg_sq: Optional[torch.Tensor] = None,
    skip_if: Optional[torch.Tensor] = None,
) -> None:
    """Shapes, dtypes and devices every backend requires; raises ValueError naming the buffer."""
    n = param.numel()
    state = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        state["max_exp_avg_sq"] = max_exp_avg_sq
    for name, t in state.items():
        if t.dtype != torch.float32:
            raise ValueError(f"adam_step: {name} must be float32, got {t.dtype}")
    buffers = {"param": param, "grad": grad, **state}
    if out is not None:
        buffers["out"] = out
    for name, t in buffers.items():
        if t.numel() != n:
            raise ValueError(f"adam_step: {name} has {t.numel()} elements, param has {n}")
        if not t.is_contiguous():
            raise ValueError(f"adam_step: {name} must be contiguous")
        if t.device != param.device:
            raise ValueError(f"adam_step: {name} is on {t.device}, param on {param.device}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"adam_step: grad dtype {grad.dtype}; allowed: float32, bfloat16, float16")
    for name, flag in (("found_inf", found_inf), ("skip_if", skip_if)):
        if flag is not None and (flag.numel() != 1 or flag.dtype != torch.float32):
            raise ValueError(f"adam_step: {name} must be a one-element float32 tensor")
        if flag is not None and flag.device != param.device:
            raise ValueError(f"adam_step: {name} is on {flag.device}, param on {param.device}")
    if found_inf is not None and skip_if is not None:
        raise ValueError("adam_step: pass found_inf (check the gradient, then skip) or skip_if (skip), not both")


def check_window(window: Optional[tuple[int, int]], n: int) -> tuple[int, int]:
    """``(lo, hi)`` of an Adam step's ``window`` over ``n`` elements (None: all of them); raises ValueError."""
    if window is None:
        return 0, n
    lo, hi = (int(w) for w in window)
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"adam_step: window {tuple(window)} is not within the {n} elements (0 <= lo <= hi <= n)")
    return lo, hi


def in_window(
    window: Optional[tuple[int, int]], *tensors: Optional[torch.Tensor]
) -> tuple[Optional[torch.Tensor], ...]:
    """``tensors`` (None stays None) narrowed to the elements ``window`` selects (``check_window``)."""
    lo, hi = check_window(window, tensors[0].numel())
    return tuple(None if t is None else t.narrow(0, lo, hi - lo) for t in tensors)


def check_quantized(
    quantized: Optional[QuantizedBlocks], param: torch.Tensor, window: Optional[tuple[int, int]]
) -> None:
    """``quantized`` (the int8 blocks of an Adam step's epilogue) fits ``param`` whole; raises ValueError."""
    if quantized is None:
        return
    n = param.numel()
    if quantized.bits != 8 or quantized.numel != n:
        raise ValueError(
            f"adam_step: quantized must hold 8-bit blocks of the {n} parameters, "
            f"got bits={quantized.bits} for {quantized.numel} elements"
        )
    check_buffers(quantized, param.device)
    if check_window(window, n) != (0, n):
        raise ValueError(f"adam_step: quantized covers the whole tensor; window {tuple(window)} updates part of it")


def adam_step_ref(
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
    """One Adam/AdamW step on a flat shard, in place.

    Args:
        param, exp_avg, exp_avg_sq: fp32, contiguous, same number of elements (updated in place).
        grad: fp32, bf16 or fp16, same number of elements (read only).
        lr, beta1, beta2, eps, weight_decay: hyper-parameters of this step.
        step: the step count after this update (1 on the first step).
        adamw: decoupled weight decay (AdamW) if True, L2 added to the gradient (Adam) if False.
        grad_scale: multiplier applied to the gradient first (unscale x clip x 1/accumulation);
            a float or a one-element fp32 tensor.
        found_inf: one-element fp32 flag, in/out. Set to 1 if any gradient element is not finite;
            when the flag is non-zero (set now or before the call) nothing else is written.
        out: optional low-precision buffer that receives the updated params (cast).
        adopt_out: read ``out`` first: wherever ``out`` differs from ``param`` rounded to ``out``'s
            dtype (the low-precision copy was edited since the last update wrote it), ``param`` takes
            ``out``'s value before the update (compared bit for bit). Each element costs one more
            low-precision read. No effect without ``out``.
        max_exp_avg_sq: AMSGrad (``amsgrad=True`` in ``torch.optim.AdamW``): fp32, same number of
            elements, the running maximum of ``exp_avg_sq`` (updated in place); the denominator
            uses it instead of ``exp_avg_sq``. None: plain Adam.
        maximize: ascend the gradient (``maximize=True`` in ``torch.optim.AdamW``): the scaled
            gradient is negated before the L2 term and the moments.
        skip_if: one-element fp32 flag decided elsewhere (e.g. over every rank), read only: when it
            is non-zero nothing is written; the gradient is not checked. Not with ``found_inf``.
            The fused backends read it on the device; this reference reads it on the host.
        window: ``(lo, hi)``: update only elements ``lo`` to ``hi - 1`` (and check only their
            gradients for ``found_inf``); the others are left exactly as they are. A caller whose
            piece of a flat buffer starts or ends off a 16-element boundary passes the aligned span
            around it and the piece as the window, so that the fused kernels run their vector
            variant. None: every element.
        quantized: the epilogue (ZeRO++'s int8 weights): 8-bit ``QuantizedBlocks`` of ``param.numel()``
            elements that receive ``quantize(out if out is not None else param, 8, quantized.block)`` of the
            whole tensor as the step leaves it (also when a flag skips the update), so the all-gather that
            follows sends them without a pass of its own. The fused backends quantize each block in the pass
            that wrote it; no window but the whole tensor.
    """
    check_adam_args(param, grad, exp_avg, exp_avg_sq, found_inf, out, max_exp_avg_sq, skip_if)
    check_quantized(quantized, param, window)
    _update_ref(
        param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        step=step, adamw=adamw, grad_scale=grad_scale, found_inf=found_inf, out=out, max_exp_avg_sq=max_exp_avg_sq,
        maximize=maximize, skip_if=skip_if, window=window, adopt_out=adopt_out,
    )  # fmt: skip
    if quantized is not None:
        quantize_ref(out if out is not None else param, 8, quantized.block, out=quantized)


def _update_ref(
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
    adamw: bool,
    grad_scale: Scale,
    found_inf: Optional[torch.Tensor],
    out: Optional[torch.Tensor],
    max_exp_avg_sq: Optional[torch.Tensor],
    maximize: bool,
    skip_if: Optional[torch.Tensor],
    window: Optional[tuple[int, int]],
    adopt_out: bool,
) -> None:
    """``adam_step_ref`` without the epilogue, its arguments checked."""
    param, grad, exp_avg, exp_avg_sq, out, max_exp_avg_sq = in_window(
        window, param, grad, exp_avg, exp_avg_sq, out, max_exp_avg_sq
    )
    if skip_if is not None and skip_if.item() != 0:
        return
    if found_inf is not None:
        if not bool(torch.isfinite(grad).all()):
            found_inf.fill_(1.0)
        if found_inf.item() != 0:
            return
    step_size, bc2_sqrt = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, step=step)
    if adopt_out and out is not None:
        bits = torch.int16 if out.element_size() == 2 else torch.int32
        edited = out.view(bits) != param.to(out.dtype).view(bits)
        param.copy_(torch.where(edited, out.float(), param))
    g = grad.float()
    if grad_scale is not None:
        g = g * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        if adamw:
            param.mul_(1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
    second = exp_avg_sq if max_exp_avg_sq is None else max_exp_avg_sq
    denom = (second.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if out is not None:
        out.copy_(param)


def check_flat_args(op: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]) -> None:
    """Offsets in range and devices matching; raises ValueError naming the tensor index."""
    if len(tensors) != len(offsets):
        raise ValueError(f"{op}: {len(tensors)} tensors but {len(offsets)} offsets")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{op}: the flat buffer must be 1-D and contiguous")
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if off < 0 or off + t.numel() > flat.numel():
            raise ValueError(
                f"{op}: tensor {i} ({t.numel()} elements at offset {off}) overruns the flat buffer of {flat.numel()}"
            )
        if t.device != flat.device:
            raise ValueError(f"{op}: tensor {i} is on {t.device}, the flat buffer on {flat.device}")


def _scaled(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def flatten_ref(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int], *, scale: Scale = None
) -> torch.Tensor:
    """Copy each tensor (any layout and dtype) into ``flat[offset : offset + numel]``; returns ``flat``.

    The value is cast to ``flat.dtype``; with ``scale`` it is multiplied in fp32 first.
    """
    check_flat_args("flatten", tensors, flat, offsets)
    for t, off in zip(tensors, offsets):
        flat.narrow(0, off, t.numel()).copy_(_scaled(t.reshape(-1), scale, flat.dtype))
    return flat


def unflatten_ref(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int], *, scale: Scale = None
) -> None:
    """Copy ``flat[offset : offset + numel]`` back into each tensor in place (it keeps its storage)."""
    check_flat_args("unflatten", tensors, flat, offsets)
    for t, off in zip(tensors, offsets):
        t.copy_(_scaled(flat.narrow(0, off, t.numel()), scale, t.dtype).view(t.shape))

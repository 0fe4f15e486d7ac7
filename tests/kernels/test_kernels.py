"""Triton kernels and the backend dispatcher against the reference twins and torch.optim.AdamW.

Without CUDA the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1), so
sizes stay small: 1, 7 and 4097 (smaller than, equal to a few, and one past a block).
"""

from __future__ import annotations

import ctypes
import math
import sys
import types

import pytest
import torch

from tests.helpers.check import assert_close
from zero_kernels import _ext
from zero_kernels.kernels import (
    QuantizedBlocks,
    adam_step,
    adam_step_ref,
    flatten,
    flatten_ref,
    resolve_impl,
    triton_adam,
    triton_flatten,
    unflatten,
    unflatten_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RTOL = 1.3e-6  # DESIGN.md: fp32 relative error per step
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LOW = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _randn(n: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype).to(DEVICE)


def _adam_state(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v = _randn(n, 2, 1e-2) ** 2
    return _randn(n, 0), _randn(n, 1, 1e-2), v


def _check_state(ours: dict, ref: dict, before: torch.Tensor, what: str) -> None:
    """One step's error: param within RTOL of itself plus RTOL of the oracle's update (``before`` is
    the param the step started from); the moments within RTOL of their largest element."""
    update = (ref["param"] - before).abs()
    assert_close(ours["param"], ref["param"], rtol=RTOL, atol=RTOL * update, what=f"{what} param")
    for name in ("exp_avg", "exp_avg_sq"):
        scale = ref[name].abs().max().item()
        assert_close(ours[name], ref[name], rtol=RTOL, atol=RTOL * scale, what=f"{what} {name}")


def _sync(ours: dict, ref: dict) -> None:
    """Start the next step from the oracle's state: the contract bounds the error of each step,
    and the rounding differences of earlier steps would otherwise add up."""
    for name in ("param", "exp_avg", "exp_avg_sq"):
        ours[name].copy_(ref[name])


# ---------------------------------------------------------------------------------------------
# Adam: Triton vs the reference, every buffer written in place


def _buffers(n: int, grad_dtype: torch.dtype, out_dtype, found_inf: bool) -> dict:
    param, exp_avg, exp_avg_sq = _adam_state(n)
    return {
        "param": param,
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "out": None if out_dtype is None else torch.full((n,), -3.0, dtype=out_dtype, device=DEVICE),
        "found_inf": torch.zeros(1, device=DEVICE) if found_inf else None,
    }


def _clone(buffers: dict) -> dict:
    return {k: None if v is None else v.clone() for k, v in buffers.items()}


def _run(fn, buffers: dict, grad: torch.Tensor, **kwargs) -> None:
    fn(buffers["param"], grad, buffers["exp_avg"], buffers["exp_avg_sq"], out=buffers["out"],
       found_inf=buffers["found_inf"], **kwargs)  # fmt: skip


SCALES = {"none": None, "float": 0.37, "tensor": 0.61}
EXTRAS = {"plain": (None, False), "found_inf": (None, True), "out": ("low", False), "out+found_inf": ("low", True)}


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("n", [1, 7, 4097])
def test_adam_matches_reference(n: int, grad_dtype: torch.dtype, adamw: bool, scale: str, extras: str) -> None:
    out_kind, with_flag = EXTRAS[extras]
    out_dtype = None if out_kind is None else (torch.float16 if grad_dtype == torch.float16 else torch.bfloat16)
    ours = _buffers(n, grad_dtype, out_dtype, with_flag)
    ref = _clone(ours)
    grad_scale = SCALES[scale]
    if scale == "tensor":
        grad_scale = torch.tensor([grad_scale], device=DEVICE)
    for step in (1, 2, 3):
        lr = 1e-3 * step  # a schedule: lr changes every step
        grad = _randn(n, 10 + step, dtype=grad_dtype)
        grad_before = grad.clone()
        kwargs = dict(HYPER, lr=lr, step=step, adamw=adamw, grad_scale=grad_scale)
        before = ref["param"].clone()
        _run(adam_step, ours, grad, impl="triton", **kwargs)
        _run(adam_step_ref, ref, grad, **kwargs)
        what = f"step {step}"
        assert torch.equal(grad, grad_before), f"{what}: grad was written"
        _check_state(ours, ref, before, what)
        if out_dtype is not None:
            assert torch.equal(ours["out"], ours["param"].to(out_dtype)), f"{what}: out is not the rounded param"
            ulp = 2.0 ** -(7 if out_dtype == torch.bfloat16 else 10)  # one unit in the last place, at most
            atol = RTOL * (ref["param"] - before).abs()
            assert_close(ours["out"], ref["out"], rtol=ulp, atol=atol, what=f"{what} out")
        if with_flag:
            assert ours["found_inf"].item() == ref["found_inf"].item() == 0.0
        _sync(ours, ref)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_adam_fp32_matches_torch_adamw(adamw: bool) -> None:
    n, grad_scale = 4097, 0.37
    param, exp_avg, exp_avg_sq = (torch.zeros(n, device=DEVICE) for _ in range(3))
    param.copy_(_randn(n, 0))
    ref_param = torch.nn.Parameter(param.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref_param], lr=1.0, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], foreach=False)  # fmt: skip
    for step in range(1, 6):
        lr = 1e-3 * (1.0 + 0.5 * math.cos(step))  # a schedule: lr changes every step
        grad = _randn(n, 20 + step)
        ref_param.grad = grad * grad_scale
        opt.param_groups[0]["lr"] = lr
        before = param.clone()
        opt.step()
        adam_step(param, grad, exp_avg, exp_avg_sq, lr=lr, step=step, adamw=adamw, grad_scale=grad_scale,
                  impl="triton", **HYPER)  # fmt: skip
        state = opt.state[ref_param]
        ours = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        ref = {"param": ref_param.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
        _check_state(ours, ref, before, f"step {step} vs torch.optim.{cls.__name__}")
        _sync(ours, ref)


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "int8-epilogue"])
@pytest.mark.parametrize("impl", ["triton", "cpu", "torch"])
def test_adam_huge_gradient_keeps_a_finite_second_moment(impl: str, quantized: bool) -> None:
    """|g| = 1e20: g * g overflows fp32 but torch's ``(1 - beta2) * g * g`` (left to right) does not, so
    exp_avg_sq stays finite and the param moves, as in torch.optim.AdamW."""
    if impl == "cpu" and not _ext.available("ops"):
        pytest.fail("the C++ extension is required by the cpu backend's tests")
    n = 7
    device = DEVICE if impl == "triton" else torch.device("cpu")
    grad = torch.full((n,), 1e20)
    grad[::2] = -1e20
    ref_param = torch.nn.Parameter(torch.ones(n))
    ref_param.grad = grad.clone()
    opt = torch.optim.AdamW([ref_param], lr=1e-3, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)  # fmt: skip
    opt.step()
    param, exp_avg, exp_avg_sq = (
        torch.ones(n, device=device),
        torch.zeros(n, device=device),
        torch.zeros(n, device=device),
    )
    blocks = QuantizedBlocks.empty(n, 8, 8, device) if quantized else None
    adam_step(param, grad.to(device), exp_avg, exp_avg_sq, lr=1e-3, step=1, impl=impl, quantized=blocks, **HYPER)
    state = opt.state[ref_param]
    ours = {"param": param.cpu(), "exp_avg": exp_avg.cpu(), "exp_avg_sq": exp_avg_sq.cpu()}
    ref = {"param": ref_param.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
    assert bool(ref["exp_avg_sq"].isfinite().all()), "the oracle overflowed: the case tests nothing"
    _check_state(ours, ref, torch.ones(n), f"{impl} g=1e20 vs torch.optim.AdamW")


def _adam_fp64(param, grad, exp_avg, exp_avg_sq, *, lr, step) -> None:
    """The textbook AdamW update in float64: the oracle of the low-precision contract."""
    b1, b2 = HYPER["beta1"], HYPER["beta2"]
    param.mul_(1 - lr * HYPER["weight_decay"])
    exp_avg.mul_(b1).add_(grad, alpha=1 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = exp_avg_sq.sqrt() / math.sqrt(1 - b2**step) + HYPER["eps"]
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - b1**step))


@pytest.mark.parametrize("low", LOW, ids=NAMES.get)
def test_adam_low_precision_within_twice_torch_error(low: torch.dtype) -> None:
    """bf16/fp16 gradients in, a bf16/fp16 copy of the params out: our error against a float64
    oracle is at most twice that of torch.optim.AdamW (fp32, gradients upcast, params rounded)."""
    n, lr = 4097, 1e-3
    param, exp_avg, exp_avg_sq = (torch.zeros(n, device=DEVICE) for _ in range(3))
    param.copy_(_randn(n, 0))
    out = torch.empty(n, dtype=low, device=DEVICE)
    oracle = [
        param.double(),
        torch.zeros_like(param, dtype=torch.float64),
        torch.zeros_like(param, dtype=torch.float64),
    ]
    ref_param = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([ref_param], lr=lr, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], foreach=False)  # fmt: skip
    for step in range(1, 4):
        grad = _randn(n, 30 + step, dtype=low)
        adam_step(param, grad, exp_avg, exp_avg_sq, lr=lr, step=step, out=out, impl="triton", **HYPER)
        ref_param.grad = grad.float()
        opt.step()
        _adam_fp64(oracle[0], grad.double(), oracle[1], oracle[2], lr=lr, step=step)
        for what, ours, theirs in (("master", param, ref_param.detach()), ("copy", out, ref_param.detach().to(low))):
            err = (ours.double() - oracle[0]).abs().max().item()
            torch_err = (theirs.double() - oracle[0]).abs().max().item()
            assert err <= 2 * torch_err, f"step {step} {what}: error {err:.3g} > 2 x torch's {torch_err:.3g}"


# ---------------------------------------------------------------------------------------------
# Adam: non-finite gradients and the found-inf flag


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=NAMES.get)
def test_adam_nonfinite_grad_sets_flag_and_writes_nothing(grad_dtype: torch.dtype, bad: float, where: str) -> None:
    n = 4097
    grad = _randn(n, 3, dtype=grad_dtype)
    grad[0 if where == "first" else n - 1] = bad
    buffers = _buffers(n, grad_dtype, torch.bfloat16, found_inf=True)
    before = _clone(buffers)
    _run(adam_step, buffers, grad, impl="triton", lr=1e-3, step=1, grad_scale=torch.tensor([0.5], device=DEVICE),
         **HYPER)  # fmt: skip
    assert buffers["found_inf"].item() == 1.0, "found_inf was not set"
    for name in ("param", "exp_avg", "exp_avg_sq", "out"):
        assert torch.equal(buffers[name], before[name]), f"{name} was written although the gradient is not finite"


@pytest.mark.parametrize("n", [7, 4097])
def test_adam_flag_already_set_writes_nothing(n: int) -> None:
    buffers = _buffers(n, torch.float32, torch.bfloat16, found_inf=True)
    buffers["found_inf"].fill_(1.0)
    before = _clone(buffers)
    _run(adam_step, buffers, _randn(n, 4), impl="triton", lr=1e-3, step=1, **HYPER)
    for name in ("param", "exp_avg", "exp_avg_sq", "out", "found_inf"):
        assert torch.equal(buffers[name], before[name]), f"{name} was written although found_inf was set"


@pytest.mark.parametrize("impl", ["torch", "cpu", "triton"])
def test_adam_skip_if_is_read_not_checked(impl: str) -> None:
    """``skip_if``: a flag decided elsewhere (over every rank); set, nothing is written; clear, the step is
    the step without a flag, a NaN in the gradient included (it is not checked); never written."""
    if impl == "cpu" and DEVICE.type != "cpu":
        pytest.skip("the C++ kernels take CPU tensors")
    n = 4097
    grad = _randn(n, 6)
    grad[5] = math.nan
    kwargs = dict(HYPER, lr=1e-3, step=3, impl=impl, grad_scale=torch.tensor([0.5], device=DEVICE))
    skipped = _buffers(n, torch.float32, torch.bfloat16, found_inf=False)
    before = _clone(skipped)
    flag = torch.ones(1, device=DEVICE)
    _run(adam_step, skipped, grad, skip_if=flag, **kwargs)
    for name in ("param", "exp_avg", "exp_avg_sq", "out"):
        assert torch.equal(skipped[name], before[name]), f"{impl}: {name} was written although skip_if was set"
    assert flag.item() == 1.0
    taken = _buffers(n, torch.float32, torch.bfloat16, found_inf=False)
    plain = _clone(taken)
    flag = torch.zeros(1, device=DEVICE)
    _run(adam_step, taken, grad, skip_if=flag, **kwargs)
    _run(adam_step, plain, grad, **kwargs)
    assert flag.item() == 0.0, f"{impl}: skip_if was written"
    assert taken["param"][5].isnan(), f"{impl}: a clear skip_if must not check the gradient"
    for name in ("param", "exp_avg", "exp_avg_sq", "out"):
        torch.testing.assert_close(taken[name], plain[name], rtol=0, atol=0, equal_nan=True, msg=f"{impl} {name}")
    with pytest.raises(ValueError, match="found_inf .* or skip_if .*, not both"):
        adam_step(taken["param"], grad, taken["exp_avg"], taken["exp_avg_sq"], found_inf=flag, skip_if=flag, **kwargs)
    with pytest.raises(ValueError, match="skip_if must be a one-element float32 tensor"):
        adam_step(taken["param"], grad, taken["exp_avg"], taken["exp_avg_sq"], skip_if=flag.double(), **kwargs)


def test_adam_bad_arguments_name_the_buffer() -> None:
    n = 7
    param, exp_avg, exp_avg_sq = _adam_state(n)
    grad = _randn(n, 5)
    kwargs = dict(HYPER, lr=1e-3, step=1, impl="triton")
    with pytest.raises(ValueError, match="grad_scale must be a float or a one-element float32 tensor"):
        adam_step(param, grad, exp_avg, exp_avg_sq, grad_scale=torch.ones(2, device=DEVICE), **kwargs)
    with pytest.raises(ValueError, match="out dtype torch.int32; allowed: float32, bfloat16, float16"):
        adam_step(param, grad, exp_avg, exp_avg_sq, out=torch.zeros(n, dtype=torch.int32, device=DEVICE), **kwargs)
    with pytest.raises(ValueError, match="exp_avg must be float32"):
        adam_step(param, grad, exp_avg.half(), exp_avg_sq, **kwargs)
    with pytest.raises(ValueError, match="grad has 6 elements"):
        adam_step(param, grad[:6], exp_avg, exp_avg_sq, **kwargs)


# ---------------------------------------------------------------------------------------------
# Flatten / unflatten


def _bucket(fill, count: int = 120) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], int]:
    """(views, their base tensors, offsets, flat size): odd shapes, mixed dtypes, strided views."""
    views, bases = [], []
    for i in range(count):
        dtype = DTYPES[i % 3]
        a, b, c = 1 + i % 5, 2 + i % 7, 3 + i % 4
        kind = i % 8
        base = fill((a + 1, 2 * b, 3 * c), dtype, i)
        if kind == 0:
            view = base
        elif kind == 1:
            view = base.transpose(0, 2)
        elif kind == 2:
            view = base[:, ::2, 1::3]
        elif kind == 3:
            view = base[1:, :, 0]
        elif kind == 4:
            view = base.permute(2, 0, 1)[::2]
        elif kind == 5:
            base = fill((), dtype, i)
            view = base
        elif kind == 6 and i % 16 == 6:
            base = fill((0, 3), dtype, i)
            view = base
        elif kind == 6:  # six strided dimensions: beyond the kernel's four, copied by the reference path
            base = fill((2, 3, 2, 3, 2, 4), dtype, i)
            view = base.permute(5, 3, 1, 4, 2, 0)[::3]
        else:
            view = base[::2, 1:, ::2].transpose(1, 2)
        views.append(view)
        bases.append(base)
    offsets, pos = [], 5
    for i, view in enumerate(views):
        offsets.append(pos)
        pos += view.numel() + i % 3
    return views, bases, offsets, pos + 2


def _random_fill(shape, dtype, i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def _sentinel_fill(shape, dtype, i):
    return torch.full(shape, -7.0, dtype=dtype, device=DEVICE)


FLAT_SCALES = {"none": None, "float": 0.3, "tensor": 1.7}
# the low-precision buffers take seconds each through the interpreter: fp32 is the fast tier's case
FLAT_DTYPES = [pytest.param(d, id=NAMES[d], marks=[pytest.mark.slow] if d in LOW else []) for d in DTYPES]


def _scale(name: str):
    value = FLAT_SCALES[name]
    return torch.tensor([value], device=DEVICE) if name == "tensor" else value


@pytest.mark.parametrize("scale", list(FLAT_SCALES))
@pytest.mark.parametrize("flat_dtype", FLAT_DTYPES)
def test_flatten_matches_reference(flat_dtype: torch.dtype, scale: str) -> None:
    views, _, offsets, size = _bucket(_random_fill)
    assert any(not v.is_contiguous() for v in views) and len({v.dtype for v in views}) == 3
    ours = torch.full((size,), 9.0, dtype=flat_dtype, device=DEVICE)
    ref = ours.clone()
    result = flatten(views, ours, offsets, scale=_scale(scale), impl="triton")
    flatten_ref(views, ref, offsets, scale=_scale(scale))
    assert result is ours
    assert torch.equal(ours, ref), f"flat differs from flatten_ref: {(ours != ref).sum().item()} elements"


@pytest.mark.parametrize("scale", list(FLAT_SCALES))
@pytest.mark.parametrize("flat_dtype", FLAT_DTYPES)
def test_unflatten_matches_reference_in_place(flat_dtype: torch.dtype, scale: str) -> None:
    _, _, offsets, size = _bucket(_sentinel_fill)
    flat = _randn(size, 7, dtype=flat_dtype)
    ours_views, ours_bases, _, _ = _bucket(_sentinel_fill)
    ref_views, ref_bases, _, _ = _bucket(_sentinel_fill)
    pointers = [v.data_ptr() for v in ours_views]
    unflatten(flat, ours_views, offsets, scale=_scale(scale), impl="triton")
    unflatten_ref(flat, ref_views, offsets, scale=_scale(scale))
    assert [v.data_ptr() for v in ours_views] == pointers, "a tensor lost its storage"
    for i, (ours, ref) in enumerate(zip(ours_bases, ref_bases)):  # the views, and what lies between them
        assert torch.equal(ours, ref), f"tensor {i} ({tuple(ours_views[i].stride())} strides) differs"


def _low_address_scale(value: float) -> torch.Tensor:
    """A one-element fp32 tensor at an address below 2**31 (a fixed anonymous mapping), as a small heap can give."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for want in range(0x30000000, 0x70000000, 0x1000000):
        got = libc.mmap(want, 4096, 3, 0x22 | 0x100000, -1, 0)  # read/write, private anonymous, fixed, no replace
        if got == want:
            scale = torch.frombuffer((ctypes.c_float * 1).from_address(got), dtype=torch.float32)
            return scale.fill_(value)
    raise AssertionError("no free page below 2**31 to map")


@pytest.mark.skipif(DEVICE.type != "cpu" or not sys.platform.startswith("linux"), reason="a host address (Linux)")
def test_a_scale_tensor_at_a_low_address() -> None:
    views, _, offsets, size = _bucket(_random_fill)
    ours = torch.full((size,), 9.0, device=DEVICE)
    ref = ours.clone()
    scale = _low_address_scale(0.61)
    assert scale.data_ptr() < 2**31
    flatten(views, ours, offsets, scale=scale, impl="triton")
    flatten_ref(views, ref, offsets, scale=scale)
    assert torch.equal(ours, ref)


@pytest.mark.slow
def test_flatten_unflatten_round_trip() -> None:
    views, _, offsets, size = _bucket(_random_fill)
    flat = torch.zeros(size, device=DEVICE)
    flatten(views, flat, offsets, scale=4.0, impl="triton")
    back, back_bases, _, _ = _bucket(_sentinel_fill)
    unflatten(flat, back, offsets, scale=0.25, impl="triton")
    for i, (v, b) in enumerate(zip(views, back)):
        assert torch.equal(v, b), f"tensor {i} did not survive the round trip"


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy cast to fp16 inf
@pytest.mark.parametrize("low", LOW, ids=NAMES.get)
def test_flatten_rounds_like_torch(low: torch.dtype) -> None:
    """Ties, overflow, infinities, zeros and subnormals round to the same bits as ``Tensor.to``; nan stays nan
    (its bits differ between torch's own CPU and CUDA casts)."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0x477FF000, 0x00000001, 0x80000000,
                         0x7F800000, 0xFF800000, 0x7FC00000, 0x33800001, 0x38800000], dtype=torch.int64)  # fmt: skip
    special = bits.to(torch.int32).view(torch.float32)
    values = torch.cat([special, torch.randn(1000) * 1e3]).to(DEVICE)
    flat = torch.zeros(values.numel(), dtype=low, device=DEVICE)
    flatten([values], flat, [0], impl="triton")
    expected = values.to(low)
    nan = values.isnan()
    assert bool(flat[nan].isnan().all()), "nan did not stay nan"
    ours, theirs = flat[~nan].view(torch.int16), expected[~nan].view(torch.int16)
    assert torch.equal(ours, theirs), f"bits differ at {(ours != theirs).nonzero().flatten()[:5].tolist()}"


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16], ids=NAMES.get)
def test_flatten_every_layout_path(flat_dtype: torch.dtype) -> None:
    """Aligned (vectorised), contiguous, strided and reference-path tensors in one bucket."""
    aligned = [_randn(32, 40), _randn(48, 41, dtype=torch.bfloat16), _randn(64, 42, dtype=torch.float16)]
    contiguous = [_randn(17, 43), _randn(16, 44, dtype=torch.bfloat16)]  # odd size; then an odd offset
    strided = [_randn(64, 45).view(8, 8).t(), _randn(96, 46, dtype=torch.float16)[::3]]
    fallback = [_randn(64, 47).view(2, 2, 2, 2, 2, 2).permute(5, 3, 1, 4, 2, 0)[:, ::2]]
    tensors = aligned + contiguous + strided + fallback
    offsets = [0, 32, 80, 144, 161, 177, 241, 300]
    flat = torch.full((340,), 5.0, dtype=flat_dtype, device=DEVICE)
    assert triton_flatten.bucket_layouts(tensors, offsets, flat) == {
        "aligned": 3, "contiguous": 2, "strided": 2, "fallback": 1
    }  # fmt: skip
    ref = flat.clone()
    flatten(tensors, flat, offsets, scale=0.5, impl="triton")
    flatten_ref(tensors, ref, offsets, scale=0.5)
    assert torch.equal(flat, ref), f"{(flat != ref).sum().item()} elements differ"
    ours_back = [torch.zeros_like(t) for t in tensors[:3]] + [t.clone() for t in tensors[3:]]
    ref_back = [t.clone() for t in ours_back]
    unflatten(flat, ours_back, offsets, scale=2.0, impl="triton")
    unflatten_ref(flat, ref_back, offsets, scale=2.0)
    for i, (a, b) in enumerate(zip(ours_back, ref_back)):
        assert torch.equal(a, b), f"tensor {i} differs after unflatten"


def test_flatten_table_is_cached() -> None:
    """Several tensors: a table per set of addresses. One tensor: a table per layout, whatever its address."""
    views, _, offsets, size = _bucket(_random_fill, count=12)
    flat = torch.zeros(size, device=DEVICE)
    triton_flatten.cache_clear()
    flatten(views, flat, offsets, impl="triton")
    assert triton_flatten.cache_info() == {"hits": 0, "misses": 1, "host_copies": 1, "size": 1}
    views[3].mul_(2.0)  # new values, same storage: the table still holds
    flatten(views, flat, offsets, scale=0.5, impl="triton")
    assert triton_flatten.cache_info() == {"hits": 1, "misses": 1, "host_copies": 1, "size": 1}
    expected = flatten_ref(views, torch.zeros_like(flat), offsets, scale=0.5)
    assert torch.equal(flat, expected)
    views[0] = views[0].clone()  # new storage: a new table
    flatten(views, flat, offsets, impl="triton")
    assert triton_flatten.cache_info() == {"hits": 1, "misses": 2, "host_copies": 2, "size": 2}
    assert torch.equal(flat, flatten_ref(views, torch.zeros_like(flat), offsets))
    held = [_randn(37, 50 + i) for i in range(3)]  # alive together: three addresses, one layout
    for i, t in enumerate(held):
        flatten([t], flat, [3], scale=float(i + 1), impl="triton")
        assert torch.equal(flat[3:40], t * (i + 1)), f"one tensor at a new address ({i}) was not copied from there"
    assert triton_flatten.cache_info() == {"hits": 3, "misses": 3, "host_copies": 3, "size": 3}


def test_collapse_layout() -> None:
    x = torch.zeros(4, 5, 6)
    assert triton_flatten.collapse_layout(x.shape, x.stride()) == ([1, 1, 1, 120], [0, 0, 0, 1])
    y = x.transpose(0, 2)
    assert triton_flatten.collapse_layout(y.shape, y.stride()) == ([1, 6, 5, 4], [0, 1, 6, 30])
    z = x[:, ::2, :]
    assert triton_flatten.collapse_layout(z.shape, z.stride()) == ([1, 4, 3, 6], [0, 30, 12, 1])
    s = x[:, :, ::2].unsqueeze(1)
    assert triton_flatten.collapse_layout(s.shape, s.stride()) == ([1, 1, 1, 60], [0, 0, 0, 2])
    w = torch.zeros(2, 3, 2, 3, 2).permute(4, 2, 0, 3, 1)
    assert triton_flatten.collapse_layout(w.shape, w.stride()) is None


def test_flatten_bad_arguments() -> None:
    t = [torch.ones(3, device=DEVICE)]
    with pytest.raises(ValueError, match="flat buffer dtype torch.int32; allowed"):
        flatten(t, torch.zeros(3, dtype=torch.int32, device=DEVICE), [0], impl="triton")
    with pytest.raises(ValueError, match="scale must be a float or a one-element float32 tensor"):
        flatten(t, torch.zeros(3, device=DEVICE), [0], scale=torch.ones(2, device=DEVICE), impl="triton")
    with pytest.raises(ValueError, match="tensor 0 .* overruns the flat buffer"):
        flatten(t, torch.zeros(3, device=DEVICE), [1], impl="triton")
    with pytest.raises(ValueError, match="tensor 0 has a stride of 0"):
        unflatten(torch.zeros(6, device=DEVICE), [torch.zeros(3, device=DEVICE).expand(2, 3)], [0], impl="triton")


# ---------------------------------------------------------------------------------------------
# Dispatcher


def test_unknown_impl_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="allowed: auto, triton, cpu, torch"):
        resolve_impl("cuda", DEVICE)
    with pytest.raises(ValueError, match="allowed: auto, triton, cpu, torch"):
        flatten([], torch.zeros(1), [], impl="fast")


def test_impl_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZERO_KERNELS_IMPL", "torch")
    assert resolve_impl(None, DEVICE) == "torch"
    monkeypatch.setenv("ZERO_KERNELS_IMPL", "triton")
    assert resolve_impl(None, DEVICE) == "triton"


def test_auto_choice_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_impl("auto", torch.device("cuda")) == "triton"
    assert resolve_impl("auto", torch.device("meta")) == "torch"
    monkeypatch.setattr(_ext, "available", lambda name: False)
    assert resolve_impl("auto", torch.device("cpu")) == "torch"


def test_auto_uses_the_cpu_extension_when_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fake = types.ModuleType("zero_kernels.kernels.cpu")
    fake.adam_step_cpu = lambda *args, **kwargs: calls.append(("adam_step", kwargs["lr"]))
    fake.flatten_cpu = lambda tensors, flat, offsets, *, scale: calls.append(("flatten", scale))
    fake.unflatten_cpu = lambda flat, tensors, offsets, *, scale: calls.append(("unflatten", scale))
    monkeypatch.setitem(sys.modules, "zero_kernels.kernels.cpu", fake)
    monkeypatch.setattr(_ext, "available", lambda name: True)
    monkeypatch.setattr(_ext, "load", lambda name: fake)
    p, m, v = _adam_state(3)
    adam_step(p.cpu(), p.cpu(), m.cpu(), v.cpu(), lr=0.5, step=1, impl="auto", **HYPER)
    flatten([torch.ones(2)], torch.zeros(2), [0], scale=2.0, impl="cpu")
    unflatten(torch.zeros(2), [torch.ones(2)], [0], scale=3.0)
    assert calls == [("adam_step", 0.5), ("flatten", 2.0), ("unflatten", 3.0)]


def test_cpu_impl_without_extension_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(name):
        raise _ext.ExtensionUnavailable("cannot build zero_kernels extension 'ops': ninja is not installed")

    monkeypatch.setattr(_ext, "load", unavailable)
    with pytest.raises(_ext.ExtensionUnavailable, match="ninja is not installed"):
        flatten([torch.ones(2)], torch.zeros(2), [0], impl="cpu")
    with pytest.raises(ValueError, match="impl='cpu' runs on CPU tensors"):
        resolve_impl("cpu", torch.device("meta"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_adam, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        param, exp_avg, exp_avg_sq = (t.cpu() for t in _adam_state(3))
        adam_step(param, torch.zeros(3), exp_avg, exp_avg_sq, lr=1e-3, step=1, impl="triton", **HYPER)
    assert resolve_impl("triton", torch.device("cuda")) == "triton"


def test_torch_impl_is_the_reference() -> None:
    ours = _buffers(7, torch.float32, torch.bfloat16, True)
    ref = _clone(ours)
    grad = _randn(7, 6)
    _run(adam_step, ours, grad, impl="torch", lr=1e-3, step=2, **HYPER)
    _run(adam_step_ref, ref, grad, lr=1e-3, step=2, **HYPER)
    for name in ours:
        assert torch.equal(ours[name], ref[name]), name

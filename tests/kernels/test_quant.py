"""Block quantization (``kernels.quant``) against a float64 computation, in every input dtype and awkward size.

The oracle recomputes each block in float64: the scale ``absmax / qmax`` rounded once to float32 (the
correctly rounded float32 quotient; one float32 ulp smaller where ``qmax * scale`` would round past the
float32 maximum), each integer ``round_half_even(fp32(x / scale))`` clamped to
``[-qmax, qmax]``. Integers and scales must match it exactly. The dequantized values must lie within the
derived bound of the float64 input: ``scale/2`` from the rounding to an integer, ``qmax*scale*2**-22`` for
float32's rounding of ``x/scale`` and of ``q*scale`` (each at most half an ulp of a value of magnitude
``<= qmax*scale``, counted twice for margin), plus for a bf16/fp16 output one ulp of that dtype at
``|q*scale|`` (the float32 product is rounded again) and its smallest subnormal step.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import pytest
import torch

from zero_kernels.kernels import QuantizedBlocks, dequantize, dequantize_ref, quantize, quantize_ref, tuning
from zero_kernels.kernels.quant_reference import QMAX, unpack

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
IMPLS = ["torch", "cpu", "triton"]  # the reference, the C++ kernel, the Triton kernel (interpreted without CUDA)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK = 64
F32_OVERFLOW = 2.0**128 - 2.0**103  # the smallest value float32 rounds to inf: its maximum plus half an ulp


def _device(impl: str) -> torch.device:
    return DEVICE if impl == "triton" else torch.device("cpu")


def _backend(impl: str) -> tuple[Callable[..., QuantizedBlocks], Callable[..., torch.Tensor]]:
    """quantize and dequantize of one backend on CPU tensors in and out (run on the backend's device)."""
    device = _device(impl)

    def quant(x: torch.Tensor, bits: int, block: int) -> QuantizedBlocks:
        return _to(quantize(x.to(device), bits, block, impl=impl), torch.device("cpu"))

    def dequant(qb: QuantizedBlocks, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(_to(qb, device), dtype, impl=impl).cpu()

    return quant, dequant


def _to(qb: QuantizedBlocks, device: torch.device) -> QuantizedBlocks:
    return QuantizedBlocks(qb.data.to(device), qb.scales.to(device), qb.numel, qb.bits, qb.block)


def _oracle(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers, scales) of ``x`` computed in float64, one block per row."""
    qmax = QMAX[bits]
    flat = x.reshape(-1).double()
    pad = (-flat.numel()) % block
    rows = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    absmax = rows.abs().amax(dim=1)
    scales = (absmax / qmax).float()
    overflows = scales.double() * qmax >= F32_OVERFLOW
    scales = torch.where(overflows, torch.nextafter(scales, torch.zeros_like(scales)), scales)
    s64 = scales.double()[:, None]
    ratio = torch.where(s64 > 0, rows / torch.where(s64 > 0, s64, 1.0), 0.0).float().double()
    q = torch.round(ratio).clamp(-qmax, qmax)
    q = torch.where(scales.isfinite()[:, None], q, 0.0)
    return q.to(torch.int8), scales


def _bound(q: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    s = scales.double()[:, None].expand_as(q)
    bound = s / 2 + QMAX[bits] * s * 2.0**-22
    if dtype != torch.float32:
        info = torch.finfo(dtype)
        bound = bound + (q.double() * s).abs() * info.eps + info.tiny * info.eps
    return bound.reshape(-1)


def _check(
    x: torch.Tensor, bits: int, block: int, impl: str, outputs: Sequence[torch.dtype] = DTYPES
) -> QuantizedBlocks:
    quant, dequant = _backend(impl)
    qb = quant(x, bits, block)
    q, scales = _oracle(x, bits, block)
    assert (qb.numel, qb.bits, qb.block) == (x.numel(), bits, block)
    assert qb.data.dtype == torch.uint8 and qb.data.numel() == q.numel() * bits // 8
    assert torch.equal(qb.scales, scales), "scales differ from the float64 absmax / qmax"
    assert torch.equal(unpack(qb.data, bits).view(-1, block), q), "integers differ from the float64 rounding"
    x64 = x.reshape(-1).double()
    for dtype in outputs:
        out = dequant(qb, dtype)
        assert out.dtype == dtype and out.shape == (x.numel(),)
        err = (out.double() - x64).abs()
        bound = _bound(q, scales, bits, dtype)[: x.numel()]
        worst = int((err - bound).argmax()) if err.numel() else 0
        assert bool((err <= bound).all()), f"to {NAMES[dtype]}: [{worst}] error {err[worst]} > bound {bound[worst]}"
    return qb


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 1001])
def test_quantize_matches_float64(impl: str, bits: int, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 3, n).sqrt()).to(dtype)
    _check(x, bits, BLOCK, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits,block", [(8, 33), (8, 1), (4, 2), (4, 4096)])
def test_any_block_size(impl: str, bits: int, block: int) -> None:
    x = torch.randn(2 * block + 3)
    _check(x, bits, block, impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_to_even_and_values_clamp(impl: str, bits: int) -> None:
    qmax = QMAX[bits]
    x = torch.tensor([float(qmax), 0.5, 1.5, 2.5, -0.5, -2.5, -float(qmax), 3.5])  # scale exactly 1
    qb = _check(x, bits, 8, impl)
    assert unpack(qb.data, bits).tolist() == [qmax, 0, 2, 2, 0, -2, -qmax, 4]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_blocks_near_the_dtype_maximum_dequantize_finite(impl: str, bits: int, dtype: torch.dtype) -> None:
    """Blocks whose absmax is the input dtype's maximum (float32's: 127 times its scale rounds past it), its
    negative, or 3e38 come back finite and within the bound in every output dtype that can hold them."""
    top = torch.finfo(dtype).max
    tops = [top, -top, 3.0e38] if dtype == torch.float32 else [top, -top]
    x = torch.tensor([[t, t / 3, -t / 2, 1.0, 0.0, t / 7, -t, t] for t in tops]).to(dtype).reshape(-1)
    outputs = [d for d in DTYPES if torch.finfo(d).max >= top]
    qb = _check(x, bits, 8, impl, outputs)
    for dtype in outputs:
        out = _backend(impl)[1](qb, dtype)
        assert bool(out.isfinite().all()), f"to {NAMES[dtype]}: non-finite at {(~out.isfinite()).nonzero().tolist()}"


@pytest.mark.parametrize("impl", IMPLS)
def test_int4_packs_low_nibble_first(impl: str) -> None:
    qb = _backend(impl)[0](torch.tensor([1.0, -1.0, 7.0, -7.0]), 4, 4)
    assert qb.data.tolist() == [0xF1, 0x97]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_all_zero_blocks(impl: str, bits: int, dtype: torch.dtype) -> None:
    x = torch.randn(3 * BLOCK + 5).to(dtype)
    x[BLOCK : 2 * BLOCK] = 0
    x[3 * BLOCK :] = 0  # the padded last block, all zero
    qb = _check(x, bits, BLOCK, impl)
    assert qb.scales[1] == 0 and qb.scales[3] == 0
    assert bool((_backend(impl)[1](qb, dtype)[BLOCK : 2 * BLOCK] == 0).all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_non_finite_input_poisons_its_block_only(impl: str, bits: int, dtype: torch.dtype) -> None:
    quant, dequant = _backend(impl)
    x = torch.randn(4 * BLOCK).to(dtype)
    x[3] = float("inf")
    x[BLOCK + 5] = float("nan")
    x[2 * BLOCK + 7] = -float("inf")
    qb = quant(x, bits, BLOCK)
    assert qb.scales[0] == float("inf") and qb.scales[1].isnan() and qb.scales[2] == float("inf")
    assert bool(qb.scales[3].isfinite())
    assert bool((unpack(qb.data, bits)[: 3 * BLOCK] == 0).all()), "a non-finite block sends no integers"
    out = dequant(qb, dtype)
    assert bool(out[: 3 * BLOCK].isnan().all()), "every value of a non-finite block dequantizes to NaN"
    _check(x[3 * BLOCK :].clone(), bits, BLOCK, impl)  # the finite block is unchanged by its neighbours
    assert torch.equal(out[3 * BLOCK :], dequant(quant(x[3 * BLOCK :].clone(), bits, BLOCK), dtype))


@pytest.mark.parametrize("impl", IMPLS)
def test_out_buffers_are_written_in_place(impl: str) -> None:
    device = _device(impl)
    x = torch.randn(2 * BLOCK + 9, dtype=torch.bfloat16)
    expected = quantize_ref(x, 4, BLOCK)
    out = QuantizedBlocks.empty(x.numel(), 4, BLOCK, device)
    assert quantize(x.to(device), 4, BLOCK, out=out, impl=impl) is out
    assert torch.equal(out.data.cpu(), expected.data) and torch.equal(out.scales.cpu(), expected.scales)
    values = torch.full((x.numel(),), 123.0, dtype=torch.float16, device=device)
    assert dequantize(out, torch.float16, out=values, impl=impl) is values
    assert torch.equal(values.cpu(), dequantize_ref(expected, torch.float16))


def test_empty_input() -> None:
    qb = quantize(torch.zeros(0), 4, BLOCK)
    assert qb.nbytes() == 0 and dequantize(qb, torch.float32).numel() == 0


def test_nbytes_counts_integers_and_scales() -> None:
    assert quantize(torch.randn(1000), 4, 64).nbytes() == 16 * 32 + 16 * 4
    assert quantize(torch.randn(1000), 8, 64).nbytes() == 16 * 64 + 16 * 4


def test_reads_any_shape_flat() -> None:
    x = torch.randn(5, 7, dtype=torch.float16)
    assert torch.equal(
        dequantize(quantize(x, 8, 16), torch.float16), dequantize(quantize(x.flatten(), 8, 16), torch.float16)
    )


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: quantize(torch.randn(8), 3, 8), ValueError, "bits must be 4 or 8"),
        (lambda: quantize(torch.randn(8), 8, 0), ValueError, "block must be a positive int"),
        (lambda: quantize(torch.randn(8), 4, 7), ValueError, "block must be even"),
        (lambda: quantize(torch.arange(8), 8, 8), TypeError, "float32, bfloat16 or float16"),
        (lambda: quantize(torch.randn(8), 8, 8, out=QuantizedBlocks.empty(9, 8, 8)), ValueError, "out holds"),
        (lambda: dequantize(quantize(torch.randn(8), 8, 8), torch.float64), TypeError, "dtype must be"),
        (lambda: dequantize(quantize(torch.randn(8), 8, 8), torch.float32, out=torch.empty(7)), ValueError, "8 el"),
    ],
)
def test_bad_arguments_name_what_is_wrong(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call()


def test_triton_launches_on_the_device_of_their_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both Triton launches make their tensors' device current (``tuning.launch_device``), as the Adam and
    flatten launches do: the current device may be another one when they run."""
    seen: list[torch.Tensor] = []

    def record(tensor: torch.Tensor) -> contextlib.nullcontext:
        seen.append(tensor)
        return contextlib.nullcontext()

    monkeypatch.setattr(tuning, "launch_device", record)
    x = torch.randn(100, device=DEVICE)
    qb = quantize(x, 4, BLOCK, impl="triton")
    out = dequantize(qb, torch.float32, impl="triton")
    assert [t.data_ptr() for t in seen] == [x.data_ptr(), out.data_ptr()]
    assert all(t.device == DEVICE for t in seen)

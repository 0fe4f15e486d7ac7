"""The Adam step's epilogue (``adam_step(..., quantized=)``): the int8 blocks of the parameters it wrote.

The oracle is the definition: the same backend's plain Adam step, then ``quantize_ref`` of what it wrote
(the low-precision ``out``, else the fp32 params). Every buffer the fused step writes (params, moments,
``out``, AMSGrad's maximum) must equal the plain step's bit for bit, and the integers and scales must equal
the reference quantizer's bit for bit: in fp32, bf16 and fp16, odd sizes, several blocks (powers of two or
not, as ``Payload`` picks them), with adopted edits, AMSGrad, a gradient scale, a skipped step (the blocks
of the parameters as they are) and non-finite values (a block holding one gets a non-finite scale and
integers 0, as the quantizer does). Triton runs in the interpreter without CUDA: sizes stay small.
"""

from __future__ import annotations

import pytest
import torch

from zero_kernels import _ext
from zero_kernels.kernels import QuantizedBlocks, adam_step, dequantize_ref, quantize_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["triton", "cpu", "torch"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, step=3)
# (numel, block): one partial block, odd sizes over several blocks, a block that is no power of two (as
# Payload makes them: even, a multiple of 4), one not a multiple of 4, and a full 2048-element block
SIZES = [(7, 8), (333, 64), (1000, 212), (97, 30), (2048 + 17, 2048)]


def _device(impl: str) -> torch.device:
    if impl == "cpu" and not _ext.available("ops"):
        pytest.fail("the C++ extension is required by the cpu backend's tests")
    return DEVICE if impl == "triton" else torch.device("cpu")


def _state(n: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g) * 3
    state = {
        "param": param,
        "grad": torch.randn(n, generator=g).to(dtype),
        "exp_avg": torch.randn(n, generator=g) * 1e-2,
        "exp_avg_sq": torch.rand(n, generator=g) * 1e-2,
        "max_exp_avg_sq": torch.rand(n, generator=g) * 1e-2,
        "out": None if dtype == torch.float32 else param.to(dtype),
    }
    return {k: None if v is None else v.to(device) for k, v in state.items()}


def _clone(state: dict) -> dict:
    return {k: None if v is None else v.clone() for k, v in state.items()}


def _step(impl: str, s: dict, quantized=None, **kw) -> None:
    adam_step(s["param"], s["grad"], s["exp_avg"], s["exp_avg_sq"], out=s["out"], impl=impl, quantized=quantized,
              **HYPER, **kw)  # fmt: skip


def _blocks(n: int, block: int, device: torch.device) -> QuantizedBlocks:
    qb = QuantizedBlocks.empty(n, 8, block, device)
    qb.data.fill_(0xAB)  # garbage: every byte must be written
    qb.scales.fill_(-1.0)
    return qb


def _check(impl: str, state: dict, block: int, what: str, **kw) -> None:
    """The fused step against the plain step of ``impl`` then the reference quantizer, bit for bit."""
    plain, fused = _clone(state), _clone(state)
    n = state["param"].numel()
    _step(impl, plain, **kw)
    qb = _blocks(n, block, state["param"].device)
    _step(impl, fused, qb, **kw)
    for name in plain:
        if plain[name] is not None:
            assert torch.equal(fused[name].cpu(), plain[name].cpu()) or (
                fused[name].isnan().equal(plain[name].isnan())
                and torch.equal(fused[name].nan_to_num().cpu(), plain[name].nan_to_num().cpu())
            ), f"{what}: {name} differs from the plain step's"
    written = plain["out"] if plain["out"] is not None else plain["param"]
    want = quantize_ref(written.cpu(), 8, block)
    assert torch.equal(qb.data.cpu(), want.data), f"{what}: integers differ from quantize_ref's"
    got, exp = qb.scales.cpu(), want.scales
    assert torch.equal(got.isnan(), exp.isnan()) and torch.equal(got.nan_to_num(), exp.nan_to_num()), (
        f"{what}: scales {got.tolist()[:4]} vs quantize_ref's {exp.tolist()[:4]}"
    )


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"n{s[0]}-block{s[1]}")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("impl", BACKENDS)
def test_epilogue_is_plain_adam_then_quantize(impl: str, dtype: str, size: tuple) -> None:
    n, block = size
    state = _state(n, DTYPES[dtype], _device(impl))
    _check(impl, state, block, f"{impl} {dtype} n={n}")
    _check(impl, state, block, f"{impl} {dtype} n={n} adam+scale", adamw=False, grad_scale=0.5)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("impl", BACKENDS)
def test_epilogue_with_amsgrad_maximize_tensor_scale_and_adopted_edits(impl: str, dtype: str) -> None:
    device = _device(impl)
    state = _state(333, DTYPES[dtype], device)
    if state["out"] is not None:
        state["out"][5:40] = 7.0  # edited since the last step: the master adopts these
    scale = torch.tensor([0.25], device=device)
    _check(impl, state, 64, f"{impl} {dtype} amsgrad", max_exp_avg_sq=state["max_exp_avg_sq"], adopt_out=True)
    _check(impl, state, 64, f"{impl} {dtype} maximize", maximize=True, grad_scale=scale, adopt_out=True)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("impl", BACKENDS)
def test_epilogue_of_a_skipped_step_quantizes_the_params_as_they_are(impl: str, dtype: str) -> None:
    device = _device(impl)
    state = _state(333, DTYPES[dtype], device)
    state["grad"][100] = float("inf")
    before = _clone(state)
    qb = _blocks(333, 64, device)
    flag = torch.zeros(1, device=device)
    _step(impl, state, qb, found_inf=flag)
    assert flag.item() == 1.0
    written = before["out"] if before["out"] is not None else before["param"]
    assert torch.equal(qb.data.cpu(), quantize_ref(written.cpu(), 8, 64).data)
    assert torch.equal(qb.scales.cpu(), quantize_ref(written.cpu(), 8, 64).scales)
    assert torch.equal(state["param"], before["param"]), "a skipped step wrote the params"
    _check(impl, before, 64, f"{impl} {dtype} skip_if", skip_if=torch.ones(1, device=device))


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("impl", BACKENDS)
def test_epilogue_of_params_at_the_dtype_maximum_dequantizes_finite(impl: str, dtype: str) -> None:
    """Parameters at their dtype's maximum (a skipped step keeps them there): the quantizer's scale, one whose
    127 multiple is still finite, so the gathered values are finite."""
    device = _device(impl)
    state = _state(333, DTYPES[dtype], device)
    top = torch.finfo(DTYPES[dtype]).max
    written = state["param"] if state["out"] is None else state["out"]
    written[[0, 70, 140]] = torch.tensor([top, -top, top], dtype=written.dtype, device=device)
    state["param"][[0, 70, 140]] = written[[0, 70, 140]].float()
    _check(impl, state, 64, f"{impl} {dtype} at max", skip_if=torch.ones(1, device=device))
    qb = _blocks(333, 64, device)
    _step(impl, _clone(state), qb, skip_if=torch.ones(1, device=device))
    assert bool(
        dequantize_ref(QuantizedBlocks(qb.data.cpu(), qb.scales.cpu(), 333, 8, 64), DTYPES[dtype]).isfinite().all()
    )


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("impl", BACKENDS)
def test_epilogue_with_non_finite_values_is_the_quantizers(impl: str, dtype: str) -> None:
    """NaN and inf in the params or the gradient reach the written values (no found_inf): those blocks get a
    non-finite scale and integers 0, as ``quantize_ref`` gives them; the other blocks are untouched by them."""
    state = _state(333, DTYPES[dtype], _device(impl))
    state["grad"][3] = float("nan")  # block 0
    state["param"][70] = float("inf")  # block 1
    state["param"][200] = float("-inf")  # block 3
    if state["out"] is not None:
        state["out"].copy_(state["param"])
    _check(impl, state, 64, f"{impl} {dtype} non-finite")
    qb = _blocks(333, 64, state["param"].device)
    _step(impl, _clone(state), qb)
    scales = qb.scales.cpu()
    assert scales[0].isnan() and not scales[1].isfinite() and not scales[3].isfinite() and scales[2].isfinite()


@pytest.mark.parametrize("impl", BACKENDS)
def test_epilogue_refuses_what_it_cannot_write(impl: str) -> None:
    state = _state(64, torch.bfloat16, _device(impl))
    device = state["param"].device
    with pytest.raises(ValueError, match="window"):
        _step(impl, state, QuantizedBlocks.empty(64, 8, 16, device), window=(0, 32))
    with pytest.raises(ValueError, match="8-bit blocks of the 64"):
        _step(impl, state, QuantizedBlocks.empty(64, 4, 16, device))
    with pytest.raises(ValueError, match="8-bit blocks of the 64"):
        _step(impl, state, QuantizedBlocks.empty(48, 8, 16, device))
    _step(impl, state, QuantizedBlocks.empty(64, 8, 16, device), window=(0, 64))  # the whole tensor: allowed

"""C++ CPU kernels (``zero_kernels.kernels.cpu``) against the pure-PyTorch oracle and torch.optim.

Every buffer a kernel writes is compared element by element. fp32 state is allowed rounding
noise only: rtol 1e-6 plus a few units in the last place of the buffer's largest element (the
kernel fuses multiply-adds, so single elements can land one rounding step away; where values
cancel that step dominates the relative error).
"""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest
import torch

from tests.helpers.check import assert_close
from zero_kernels import _ext
from zero_kernels.kernels import cpu, reference

pytestmark = pytest.mark.ext

SIZES = [1, 7, 4097, 1_000_003]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
ULP32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", autouse=True)
def ops() -> ModuleType:
    """Builds (or loads) the extension once for this module; a failure to build is a test failure."""
    try:
        return _ext.load("ops")
    except _ext.ExtensionUnavailable as exc:
        pytest.fail(f"the C++ extension is required by these tests: {exc}")


def _state(n: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    param = torch.randn(n)
    exp_avg = torch.randn(n) * 0.1
    exp_avg_sq = torch.rand(n) * 0.01
    grad = torch.randn(n).to(grad_dtype)
    return param, grad, exp_avg, exp_avg_sq


def _close_fp32(actual: torch.Tensor, expected: torch.Tensor, what: str, *, ulps: int = 4) -> None:
    atol = ulps * ULP32 * float(expected.abs().max()) if expected.numel() else 0.0
    assert_close(actual, expected, rtol=1e-6, atol=atol, what=what)


def _scale(kind: str) -> reference.Scale:
    return {"none": None, "float": 0.37, "tensor": torch.tensor([0.37])}[kind]


def _steps_against_reference(n: int, grad_dtype: torch.dtype, adamw: bool, scale_kind: str, steps: int) -> None:
    param, _, exp_avg, exp_avg_sq = _state(n, grad_dtype)
    expected = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    for step in range(1, steps + 1):
        grad = torch.randn(n).to(grad_dtype)
        kw = dict(HYPER, step=step, adamw=adamw, grad_scale=_scale(scale_kind))
        cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, **kw)
        reference.adam_step_ref(expected[0], grad, expected[1], expected[2], **kw)
        for name, actual, want in zip(("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq), expected):
            _close_fp32(actual, want, f"{name} after step {step}")


@pytest.mark.parametrize("n", SIZES[:-1])
@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adam_matches_reference(grad_dtype: torch.dtype, adamw: bool, scale_kind: str, n: int) -> None:
    _steps_against_reference(n, grad_dtype, adamw, scale_kind, steps=3)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adam_matches_reference_large(grad_dtype: torch.dtype, adamw: bool) -> None:
    """Large enough for several threads and many blocks per thread, with a ragged tail."""
    _steps_against_reference(SIZES[-1], grad_dtype, adamw, "tensor", steps=2)


@pytest.mark.parametrize("n", [4097, 1_000_003])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_adam_matches_torch_optim(adamw: bool, n: int) -> None:
    """Each step, from the same state as torch's single-tensor AdamW/Adam: rel err <= 1.3e-6 (+1 ulp of max |p|)."""
    torch_param = torch.randn(n).requires_grad_()
    optim_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = optim_cls(
        [torch_param],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        foreach=False,
    )
    param, exp_avg, exp_avg_sq = torch_param.detach().clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 6):
        if step > 1:
            state = opt.state[torch_param]
            param.copy_(torch_param.detach())
            exp_avg.copy_(state["exp_avg"])
            exp_avg_sq.copy_(state["exp_avg_sq"])
        grad = torch.randn(n)
        torch_param.grad = grad.clone()
        opt.step()
        cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, **HYPER, step=step, adamw=adamw)
        state = opt.state[torch_param]
        expected = torch_param.detach()
        assert_close(param, expected, rtol=1.3e-6, atol=ULP32 * float(expected.abs().max()), what=f"param step {step}")
        _close_fp32(exp_avg, state["exp_avg"], f"exp_avg step {step}", ulps=2)
        _close_fp32(exp_avg_sq, state["exp_avg_sq"], f"exp_avg_sq step {step}", ulps=2)


LOW_PRECISION_CASES = [(g, o, 4097) for g in GRAD_DTYPES for o in (torch.bfloat16, torch.float16, torch.float32)] + [
    (torch.bfloat16, torch.bfloat16, n) for n in (1, 7, 1_000_003)
]


@pytest.mark.parametrize("grad_dtype, out_dtype, n", LOW_PRECISION_CASES, ids=str)
def test_adam_low_precision_copy(grad_dtype: torch.dtype, out_dtype: torch.dtype, n: int) -> None:
    param, grad, exp_avg, exp_avg_sq = _state(n, grad_dtype)
    expected = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    out = torch.full((n,), float("nan")).to(out_dtype)
    found_inf = torch.zeros(1)
    kw = dict(HYPER, step=4, grad_scale=2.0)
    cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, found_inf=found_inf, out=out, **kw)
    reference.adam_step_ref(expected[0], grad, expected[1], expected[2], **kw)
    assert found_inf.item() == 0.0
    _close_fp32(param, expected[0], "param")
    _close_fp32(exp_avg, expected[1], "exp_avg")
    _close_fp32(exp_avg_sq, expected[2], "exp_avg_sq")
    assert torch.equal(out, param.to(out_dtype)), "out must be the updated param cast to its dtype"


@pytest.mark.parametrize("n", [7, 4097, 1_000_003])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_adam_nonfinite_grad_sets_flag_and_writes_nothing(grad_dtype: torch.dtype, bad: float, n: int) -> None:
    for where in (0, n // 2, n - 1):
        param, grad, exp_avg, exp_avg_sq = _state(n, grad_dtype)
        grad[where] = bad
        out = torch.zeros(n, dtype=torch.bfloat16)
        before = [t.clone() for t in (param, exp_avg, exp_avg_sq, out)]
        found_inf = torch.zeros(1)
        cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, **HYPER, step=1, found_inf=found_inf, out=out)
        assert found_inf.item() == 1.0, f"non-finite grad at {where} not flagged"
        for name, t, b in zip(("param", "exp_avg", "exp_avg_sq", "out"), (param, exp_avg, exp_avg_sq, out), before):
            assert torch.equal(t, b), f"{name} was written although grad[{where}] = {bad}"


@pytest.mark.parametrize("n", [7, 1_000_003])
def test_adam_preset_flag_writes_nothing(n: int) -> None:
    param, grad, exp_avg, exp_avg_sq = _state(n, torch.float32)
    out = torch.zeros(n, dtype=torch.float16)
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq, out)]
    found_inf = torch.ones(1)
    cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, **HYPER, step=1, found_inf=found_inf, out=out)
    assert found_inf.item() == 1.0
    for name, t, b in zip(("param", "exp_avg", "exp_avg_sq", "out"), (param, exp_avg, exp_avg_sq, out), before):
        assert torch.equal(t, b), f"{name} was written although found_inf was already set"


def test_adam_without_flag_lets_nan_through_like_torch() -> None:
    param, grad, exp_avg, exp_avg_sq = _state(7, torch.float32)
    grad[3] = float("nan")
    cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, **HYPER, step=1)
    assert param[3].isnan() and exp_avg[3].isnan() and exp_avg_sq[3].isnan()
    assert bool(param[torch.arange(7) != 3].isfinite().all())


@pytest.mark.parametrize("threads", [1, 2])
def test_adam_same_result_for_any_thread_count(threads: int) -> None:
    param, grad, exp_avg, exp_avg_sq = _state(300_007, torch.bfloat16)
    expected = [param.clone(), exp_avg.clone(), exp_avg_sq.clone()]
    reference.adam_step_ref(expected[0], grad, expected[1], expected[2], **HYPER, step=1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu.adam_step_cpu(param, grad, exp_avg, exp_avg_sq, **HYPER, step=1)
    finally:
        torch.set_num_threads(previous)
    for name, actual, want in zip(("param", "exp_avg", "exp_avg_sq"), (param, exp_avg, exp_avg_sq), expected):
        _close_fp32(actual, want, name)


def _bad_adam_inputs() -> list[tuple[str, dict, str]]:
    n = 5
    return [
        ("param dtype", dict(param=torch.zeros(n, dtype=torch.float64)), "param must be float32"),
        ("exp_avg_sq dtype", dict(exp_avg_sq=torch.zeros(n, dtype=torch.float16)), "exp_avg_sq must be float32"),
        ("grad dtype", dict(grad=torch.zeros(n, dtype=torch.int32)), "grad dtype torch.int32"),
        ("grad size", dict(grad=torch.zeros(n + 1)), "grad has 6 elements, param has 5"),
        ("exp_avg size", dict(exp_avg=torch.zeros(n - 1)), "exp_avg has 4 elements"),
        ("strided grad", dict(grad=torch.zeros(2 * n)[::2]), "grad must be contiguous"),
        ("found_inf", dict(found_inf=torch.zeros(2)), "found_inf must be a one-element float32"),
        ("found_inf dtype", dict(found_inf=torch.zeros(1, dtype=torch.float64)), "found_inf must be a one-element"),
        ("out dtype", dict(out=torch.zeros(n, dtype=torch.int64)), "out dtype Long"),
        ("out size", dict(out=torch.zeros(n + 2, dtype=torch.bfloat16)), "out has 7 elements"),
        ("grad_scale", dict(grad_scale=torch.ones(2)), "grad_scale must be a float or a one-element"),
    ]


@pytest.mark.parametrize("case", _bad_adam_inputs(), ids=lambda c: c[0])
def test_adam_rejects_bad_input(case: tuple[str, dict, str]) -> None:
    _, override, message = case
    args = dict(param=torch.zeros(5), grad=torch.zeros(5), exp_avg=torch.zeros(5), exp_avg_sq=torch.zeros(5))
    kw: dict = dict(HYPER, step=1)
    for key, value in override.items():
        (args if key in args else kw)[key] = value
    with pytest.raises(ValueError, match=message):
        cpu.adam_step_cpu(args["param"], args["grad"], args["exp_avg"], args["exp_avg_sq"], **kw)


def test_cpp_entry_points_check_their_input(ops: ModuleType) -> None:
    """The C++ checks stand on their own (callers outside Python get them too)."""
    meta = torch.zeros(4, device="meta")
    scalars = dict(HYPER, step_size=1e-3, bc2_sqrt=1.0, adamw=True, grad_scale=None, found_inf=None, out=None)
    with pytest.raises(ValueError, match="param is on meta; this kernel needs CPU"):
        ops.adam_step(meta, meta, meta, meta, **scalars)
    with pytest.raises(ValueError, match="exp_avg has 3 elements, param has 4"):
        ops.adam_step(torch.zeros(4), torch.zeros(4), torch.zeros(3), torch.zeros(4), **scalars)
    with pytest.raises(ValueError, match="flatten: tensor 1 has dtype Int"):
        ops.flatten([torch.zeros(2), torch.zeros(2, dtype=torch.int32)], torch.zeros(4), [0, 2], scale=None)
    with pytest.raises(ValueError, match=r"unflatten: tensor 0 \(3 elements at offset 2\) overruns"):
        ops.unflatten(torch.zeros(4), [torch.zeros(3)], [2], scale=None)
    with pytest.raises(ValueError, match="flatten: 1 tensors but 2 offsets"):
        ops.flatten([torch.zeros(2)], torch.zeros(4), [0, 2], scale=None)


# ----------------------------------------------------------------------------- flatten / unflatten

FLAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _odd_tensors(count: int) -> list[torch.Tensor]:
    """Mixed shapes, dtypes and layouts: contiguous, transposed, sliced with steps, expanded, 0-d, empty."""
    gen = torch.Generator().manual_seed(1)
    tensors = []
    for i in range(count):
        dtype = FLAT_DTYPES[i % len(FLAT_DTYPES)]
        kind = i % 6
        a, b = (int(x) for x in torch.randint(1, 23, (2,), generator=gen))
        base = torch.randn(a + 2, b + 3, 3, generator=gen).to(dtype)
        if kind == 0:
            t = base
        elif kind == 1:
            t = base.transpose(0, 2)
        elif kind == 2:
            t = base[1:, ::2, 1]
        elif kind == 3:
            t = base[:, 1].t()[:, 1:]
        elif kind == 4:
            t = (
                torch.randn(b, generator=gen).to(dtype).expand(a, b)
                if i % 12 == 4
                else base.permute(1, 2, 0)[:, :, ::3]
            )
        else:
            t = torch.randn((), generator=gen).to(dtype) if i % 12 == 5 else torch.empty(0, a, dtype=dtype)
        tensors.append(t)
    tensors.append(torch.randn(700, 1500)[:, 1:1001].to(torch.bfloat16))  # one large strided tensor
    return tensors


def _offsets(tensors: list[torch.Tensor], pad: int = 3) -> tuple[list[int], int]:
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at += t.numel() + pad
    return offsets, at


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor"])
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_flatten_matches_reference(flat_dtype: torch.dtype, scale_kind: str) -> None:
    tensors = _odd_tensors(120)
    offsets, total = _offsets(tensors)
    flat = torch.full((total,), -7.0, dtype=flat_dtype)
    expected = flat.clone()
    returned = cpu.flatten_cpu(tensors, flat, offsets, scale=_scale(scale_kind))
    reference.flatten_ref(tensors, expected, offsets, scale=_scale(scale_kind))
    assert returned is flat
    assert torch.equal(flat, expected), f"flatten differs: {(flat != expected).sum()} elements (padding included)"


def _writable(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for t in tensors if t.dim() == 0 or min(t.stride()) > 0]


def _same_layout(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh random storage the size of ``t``'s and a view of it with ``t``'s sizes, strides and offset."""
    base = torch.randn(t.untyped_storage().nbytes() // t.element_size()).to(t.dtype)
    return base, base.as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor"])
@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unflatten_matches_reference_in_place(flat_dtype: torch.dtype, scale_kind: str) -> None:
    layouts = [_same_layout(t) for t in _writable(_odd_tensors(120))]
    offsets, total = _offsets([view for _, view in layouts])
    flat = torch.randn(total).to(flat_dtype)
    expected_bases = [base.clone() for base, _ in layouts]
    expected_views = [
        b.as_strided(v.shape, v.stride(), v.storage_offset()) for b, (_, v) in zip(expected_bases, layouts)
    ]
    cpu.unflatten_cpu(flat, [view for _, view in layouts], offsets, scale=_scale(scale_kind))
    reference.unflatten_ref(flat, expected_views, offsets, scale=_scale(scale_kind))
    for i, ((base, view), want) in enumerate(zip(layouts, expected_bases)):
        assert torch.equal(base, want), (
            f"tensor {i} ({tuple(view.shape)}, stride {view.stride()}) or its storage differs"
        )


@pytest.mark.parametrize("threads", [1, 2])
def test_flatten_unflatten_round_trip(threads: int) -> None:
    tensors = _writable(_odd_tensors(150))
    offsets, total = _offsets(tensors, pad=0)
    flat = torch.empty(total, dtype=torch.float64)
    copies = [torch.zeros_like(t) for t in tensors]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu.flatten_cpu(tensors, flat, offsets)
        cpu.unflatten_cpu(flat, copies, offsets)
    finally:
        torch.set_num_threads(previous)
    for i, (t, c) in enumerate(zip(tensors, copies)):
        assert torch.equal(t, c), f"tensor {i} changed in the round trip"


def test_unflatten_rejects_overlapping_target() -> None:
    target = torch.zeros(3).expand(4, 3)
    with pytest.raises(ValueError, match="unflatten: tensor 0 has elements that share memory"):
        cpu.unflatten_cpu(torch.zeros(12), [target], [0])


@pytest.mark.parametrize(
    "tensors, flat, offsets, message",
    [
        ([torch.zeros(3)], torch.zeros(4), [2], r"flatten: tensor 0 \(3 elements at offset 2\) overruns"),
        ([torch.zeros(3, dtype=torch.int64)], torch.zeros(4), [0], "flatten: tensor 0 has dtype Long; allowed"),
        ([torch.zeros(3)], torch.zeros(4, dtype=torch.int32), [0], "flatten: the flat buffer has dtype Int"),
        ([torch.zeros(3)], torch.zeros(2, 4), [0], "flatten: the flat buffer must be 1-D and contiguous"),
        ([torch.zeros(3), torch.zeros(1)], torch.zeros(4), [0], "flatten: 2 tensors but 1 offsets"),
    ],
    ids=["overrun", "tensor dtype", "flat dtype", "flat 2-D", "offsets"],
)
def test_flatten_rejects_bad_input(tensors: list, flat: torch.Tensor, offsets: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu.flatten_cpu(tensors, flat, offsets)


def test_flatten_rejects_bad_scale() -> None:
    with pytest.raises(ValueError, match="flatten: scale must be a float or a one-element float32 tensor"):
        cpu.flatten_cpu([torch.zeros(2)], torch.zeros(2), [0], scale=torch.ones(1, dtype=torch.float64))


def test_import_builds_nothing() -> None:
    code = (
        "import zero_kernels._ext as e, zero_kernels.kernels.cpu as c; assert not e._RESULTS, e._RESULTS; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

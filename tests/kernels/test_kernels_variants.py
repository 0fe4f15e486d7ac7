"""AMSGrad and maximize in every Adam backend: Triton, C++ CPU and the reference, against the
reference and against ``torch.optim.AdamW(amsgrad=..., maximize=...)``.

Every buffer written is compared element by element, after every step, each step starting from
the oracle's state (the contract bounds one step's error: fp32 rtol 1.3e-6, plus a few units in
the last place of the buffer's largest element, as in ``test_kernels_cpu``). Triton runs in the
interpreter without CUDA, so sizes stay small: 7 and 4097 (one past a block).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.check import assert_close
from zero_kernels import _ext
from zero_kernels.kernels import adam_step, adam_step_ref

RTOL = 1.3e-6
ULP32 = torch.finfo(torch.float32).eps
HYPER = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
STATE = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
VARIANTS = {"amsgrad": (True, False), "maximize": (False, True), "amsgrad+maximize": (True, True)}
BACKENDS = ["triton", "cpu", "torch"]


def _backend(impl: str) -> str:
    if impl == "cpu" and not _ext.available("ops"):
        pytest.fail("the C++ extension is required by the cpu backend's tests")
    return impl


def _state(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = torch.rand(n, generator=g) * 1e-2
    return {
        "param": torch.randn(n, generator=g),
        "exp_avg": torch.randn(n, generator=g) * 1e-2,
        "exp_avg_sq": v,
        # half above v, half below: the maximum takes both branches
        "max_exp_avg_sq": v * torch.where(torch.arange(n) % 2 == 0, 0.5, 1.5),
    }


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol = 4 * ULP32 * float(ref.abs().max()) if ref.numel() else 0.0
    assert_close(ours, ref, rtol=RTOL, atol=atol, what=what)


def _step(fn, s: dict, grad: torch.Tensor, amsgrad: bool, **kwargs) -> None:
    fn(s["param"], grad, s["exp_avg"], s["exp_avg_sq"], max_exp_avg_sq=s["max_exp_avg_sq"] if amsgrad else None,
       **kwargs)  # fmt: skip


# (variant, gradient dtype, AdamW or Adam, with grad_scale + out + found_inf): each flag meets each other option
CASES = [
    ("amsgrad", torch.float32, True, False),
    ("amsgrad", torch.bfloat16, False, True),
    ("maximize", torch.float32, False, False),
    ("maximize", torch.bfloat16, True, True),
    ("amsgrad+maximize", torch.float32, False, True),
    ("amsgrad+maximize", torch.bfloat16, True, False),
]


def _case_id(case: tuple) -> str:
    variant, dtype, adamw, extras = case
    return f"{variant}-{str(dtype)[6:]}-{'adamw' if adamw else 'adam'}{'-scale+out+found_inf' if extras else ''}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("n", [7, 4097])
@pytest.mark.parametrize("impl", BACKENDS)
def test_variant_matches_reference(impl: str, n: int, case: tuple) -> None:
    variant, grad_dtype, adamw, extras = case
    amsgrad, maximize = VARIANTS[variant]
    ours, ref = _state(n, 0), _state(n, 0)
    untouched = ours["max_exp_avg_sq"].clone()
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(10 + step)).to(grad_dtype)
        kwargs = dict(HYPER, lr=1e-3 * step, step=step, adamw=adamw, maximize=maximize)
        out_ours = out_ref = None
        if extras:
            kwargs["grad_scale"] = torch.tensor([0.37])
            out_ours, out_ref = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
            kwargs["found_inf"] = torch.zeros(1)
        _step(adam_step, ours, grad, amsgrad, out=out_ours, impl=_backend(impl), **kwargs)
        if "found_inf" in kwargs:
            kwargs["found_inf"] = torch.zeros(1)
        _step(adam_step_ref, ref, grad, amsgrad, out=out_ref, **kwargs)
        for name in STATE:
            _close(ours[name], ref[name], f"{impl} {variant} step {step} {name}")
        if not amsgrad:
            assert torch.equal(ours["max_exp_avg_sq"], untouched), "max_exp_avg_sq written without amsgrad"
        if out_ours is not None:
            assert torch.equal(out_ours, ours["param"].to(torch.bfloat16)), "out is not the rounded param"
        for name in STATE:
            ours[name].copy_(ref[name])


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_variants_match_torch_optim(impl: str, adamw: bool) -> None:
    """Every backend, AMSGrad and maximize together, step by step against torch's single-tensor AdamW/Adam."""
    n = 4097
    torch_param = torch.nn.Parameter(torch.randn(n))
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([torch_param], lr=1e-3, betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], amsgrad=True, maximize=True, foreach=False)  # fmt: skip
    s = {"param": torch_param.detach().clone(), **{k: torch.zeros(n) for k in STATE[1:]}}
    for step in range(1, 6):
        lr = 1e-3 * (1.0 + 0.5 * math.cos(step))
        opt.param_groups[0]["lr"] = lr
        grad = torch.randn(n) * (0.2 if step % 2 else 3.0)  # the second moment falls and rises: max matters
        torch_param.grad = grad.clone()
        opt.step()
        _step(adam_step, s, grad, True, lr=lr, step=step, adamw=adamw, maximize=True, impl=_backend(impl), **HYPER)
        theirs = {"param": torch_param.detach(), **{k: opt.state[torch_param][k] for k in STATE[1:]}}
        for name in STATE:
            _close(s[name], theirs[name], f"{impl} step {step} {name} vs torch.optim.{cls.__name__}")
            s[name].copy_(theirs[name])
    assert bool((s["max_exp_avg_sq"] > s["exp_avg_sq"]).any()), "the maximum never differed from exp_avg_sq"


@pytest.mark.parametrize("impl", BACKENDS)
def test_amsgrad_maximum_propagates_nan(impl: str) -> None:
    """As ``torch.maximum``: a nan in the second moment or in the stored maximum stays nan."""
    s = _state(7, 1)
    grad = torch.randn(7)
    grad[2] = math.nan
    s["max_exp_avg_sq"][4] = math.nan
    _step(adam_step, s, grad, True, lr=1e-3, step=1, impl=_backend(impl), **HYPER)
    nan = s["max_exp_avg_sq"].isnan()
    assert nan.tolist() == [False, False, True, False, True, False, False], f"nan pattern {nan.tolist()}"


@pytest.mark.parametrize("impl", BACKENDS)
def test_max_exp_avg_sq_is_checked(impl: str) -> None:
    s = _state(5, 2)
    kwargs = dict(HYPER, lr=1e-3, step=1, impl=_backend(impl))
    grad = torch.randn(5)
    with pytest.raises(ValueError, match="max_exp_avg_sq must be float32"):
        adam_step(s["param"], grad, s["exp_avg"], s["exp_avg_sq"], max_exp_avg_sq=torch.zeros(5).double(), **kwargs)
    with pytest.raises(ValueError, match="max_exp_avg_sq has 4 elements, param has 5"):
        adam_step(s["param"], grad, s["exp_avg"], s["exp_avg_sq"], max_exp_avg_sq=torch.zeros(4), **kwargs)


@pytest.mark.ext
def test_cpp_entry_point_checks_max_exp_avg_sq() -> None:
    ops = _ext.load("ops")
    scalars = dict(HYPER, lr=1e-3, step_size=1e-3, bc2_sqrt=1.0, adamw=True, grad_scale=None, found_inf=None, out=None)
    z = torch.zeros(4)
    with pytest.raises(ValueError, match="max_exp_avg_sq has 3 elements, param has 4"):
        ops.adam_step(z, z, z.clone(), z.clone(), max_exp_avg_sq=torch.zeros(3), maximize=False, **scalars)
    with pytest.raises(ValueError, match="max_exp_avg_sq must be float32"):
        ops.adam_step(z, z, z.clone(), z.clone(), max_exp_avg_sq=torch.zeros(4).half(), maximize=True, **scalars)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [7, 4097])
@pytest.mark.parametrize("impl", BACKENDS)
def test_adopt_out_takes_the_edits_of_the_low_precision_copy(impl: str, n: int, out_dtype: torch.dtype) -> None:
    """``adopt_out``: where ``out`` is no longer ``param`` rounded to its dtype, the update starts from ``out``'s
    value; elsewhere from ``param`` with its full precision. Checked against the reference step run on the
    expected start, and a skipped step adopts nothing either."""
    s = _state(n, 3)
    out = s["param"].to(out_dtype, copy=True)
    edited = torch.zeros(n, dtype=torch.bool)
    edited[::3] = True
    out[edited] = (out[edited].float() * 0.5 + 0.25).to(out_dtype)
    out[1] = s["param"][1].to(out_dtype)  # written again with the same value: not an edit
    bits = torch.int16 if out.element_size() == 2 else torch.int32
    changed = out.view(bits) != s["param"].to(out_dtype).view(bits)  # an edit that rounds the same is none
    assert changed.sum() >= n // 4 and not changed[1]
    start = torch.where(changed, out.float(), s["param"])
    grad = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    kwargs = dict(HYPER, lr=1e-3, step=2, adamw=True)
    skipped = {k: v.clone() for k, v in s.items()}
    skipped_out = out.clone()
    adam_step(skipped["param"], grad, skipped["exp_avg"], skipped["exp_avg_sq"], out=skipped_out, adopt_out=True,
              skip_if=torch.ones(1), impl=_backend(impl), **kwargs)  # fmt: skip
    assert torch.equal(skipped["param"], s["param"]) and torch.equal(skipped_out, out), "a skipped step adopted"
    ref = {**{k: v.clone() for k, v in s.items()}, "param": start.clone()}
    ref_out = torch.empty_like(out)
    _step(adam_step_ref, ref, grad, False, out=ref_out, **kwargs)
    _step(adam_step, s, grad, False, out=out, adopt_out=True, impl=_backend(impl), **kwargs)
    for name in STATE[:3]:
        _close(s[name], ref[name], f"{impl} adopt_out {out_dtype} {name}")
    assert torch.equal(out, s["param"].to(out_dtype)), "out is not the rounded param"

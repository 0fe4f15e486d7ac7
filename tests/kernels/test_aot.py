"""Every Triton kernel variant the package launches compiles lean for sm_80 and sm_90, without a GPU.

``python -m zero_kernels.kernels.aot`` runs in a child process (the kernels must be compiled, not
interpreted: this process set TRITON_INTERPRET) and compiles what ``tuning.launch_variants()``
launches with Triton's compiler and ptxas for both architectures; each variant must have no stack
frame (no spills), at most 128 registers, and 16-byte vector loads and stores where it was launched
on aligned tensors. Compiled kernels land in Triton's cache, so a second run takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT
from zero_kernels.kernels import aot, tuning


@pytest.mark.ext
def test_every_launched_variant_compiles_lean_for_sm80_and_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    report = tmp_path / "aot.json"
    cmd = [sys.executable, "-m", "zero_kernels.kernels.aot", "--arch", "80", "90", "--json", str(report)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    summary = "\n".join(line for line in done.stdout.splitlines() if line.startswith("sm_") or "compiled for" in line)
    assert report.exists(), f"{' '.join(cmd)} wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}"
    rows = json.loads(report.read_text())
    failed = [f"sm_{r['arch']} {r['kernel']} {r['variant']}: {r['problems']}" for r in rows if r["problems"]]
    assert not failed, "over the limits:\n" + "\n".join(failed) + "\n" + summary
    assert done.returncode == 0, summary
    kernels = {"_adam_kernel", "_nonfinite_kernel", "_flatten_kernel", "_quantize_kernel", "_dequantize_kernel"}
    kernels.add("_adam_quantize_kernel")
    for arch in aot.ARCHS:
        mine = [r for r in rows if r["arch"] == arch]
        assert {r["kernel"] for r in mine} == kernels, f"sm_{arch}: compiled {sorted({r['kernel'] for r in mine})}"
        for kernel in kernels:
            assert any(r["aligned"] and r["kernel"] == kernel for r in mine), f"sm_{arch} {kernel}: no aligned variant"
    calls = {c for r in rows for c in r["calls"]}
    assert len(calls) == sum(1 for _ in tuning.launch_variants()), "a call of launch_variants() launched nothing"


def test_every_axis_value_is_compiled() -> None:
    """Each value of each axis appears in some call, next to the heaviest values of the others."""
    calls = list(tuning.launch_variants())
    for function, axes in tuning.LAUNCH_AXES.items():
        mine = [values for f, values in calls if f == function]
        assert mine[0] == {name: values[0] for name, values in axes.items()}
        for name, values in axes.items():
            assert {v[name] for v in mine} == set(values), f"{function}: {name} not covered"
    assert sum(1 for _ in tuning.launch_variants(full=True)) > len(calls)


def test_limits_catch_spills_registers_and_scalar_copies() -> None:
    """What the flatten kernel compiled to before (sm_80, block 4096, 8 warps) fails each limit."""
    spilling = aot.Compiled("_flatten_kernel", 80, "", aligned=True, registers=255, stack_bytes=112)
    spilling.vector_loads = spilling.vector_stores = 4
    problems = spilling.problems()
    assert len(problems) == 3 and "112-byte stack frame" in problems[0] and "255 registers" in problems[1]
    assert "4 128-bit loads" in problems[2]
    lean = aot.Compiled("_adam_kernel", 90, "", aligned=True, registers=58, stack_bytes=0)
    lean.vector_loads = lean.vector_stores = 7
    assert lean.problems() == []
    assert (
        aot.Compiled("_adam_kernel", 90, "", error="PTXASError: ptxas failed")
        .problems()[0]
        .startswith("does not compile")
    )


def test_access_widths_from_ptx() -> None:
    ptx = """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.b64 %rd2, [ %rd3 + 8 ];
        @%p2 st.global.v2.b16 { %rs1, %rs2 }, [ %rd4 + 0 ];
        st.global.v4.b32 [ %rd5 + 0 ], { %r5, %r6, %r7, %r8 };
    """
    assert aot.access_bits(ptx) == {"load_bits": 128, "store_bits": 128, "vector_loads": 1, "vector_stores": 1}

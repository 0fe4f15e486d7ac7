"""Install zero_kernels. Nothing is compiled unless ZERO_KERNELS_BUILD_OPS=1.

By default the C++ extensions are built just in time on first use. With
``ZERO_KERNELS_BUILD_OPS=1 pip install --no-build-isolation .`` they are compiled now, against the
torch already installed (build isolation would hide it).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"_zk_setup_{name}", ROOT / "zero_kernels" / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _ext_modules() -> dict:
    if not _load("env", "env.py").settings().build_ops:
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        raise RuntimeError(
            "ZERO_KERNELS_BUILD_OPS=1 compiles against the installed torch: install torch first and run "
            "`ZERO_KERNELS_BUILD_OPS=1 pip install --no-build-isolation .`"
        ) from exc
    spec = _load("build_spec", "_build/spec.py")
    with_cuda = torch.version.cuda is not None
    kind = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    modules = [
        kind(
            name=f"zero_kernels.zero_kernels_{name}",
            sources=[
                str(Path(s).relative_to(ROOT)) for s in spec.sources(name, with_cuda=with_cuda, root=ROOT / "csrc")
            ],
            include_dirs=spec.include_dirs(ROOT / "csrc"),
            extra_compile_args={"cxx": spec.CXX_FLAGS, "nvcc": spec.NVCC_FLAGS},
            extra_link_args=spec.LD_FLAGS,
        )
        for name in spec.EXTENSIONS
    ]
    return {"ext_modules": modules, "cmdclass": {"build_ext": cpp_extension.BuildExtension}}


setup(
    packages=[*find_packages(include=["zero_kernels", "zero_kernels.*"]), "zero_kernels.csrc"],
    package_dir={"zero_kernels.csrc": "csrc"},
    package_data={"zero_kernels.csrc": ["**/*.cpp", "**/*.h", "**/*.cu", "**/*.cuh"]},
    **_ext_modules(),
)

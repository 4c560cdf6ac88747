"""``UniEPBuilder``: DeepSpeed's JIT op builder for the UniEP CUDA kernels (sm_90a).

Sources are absolute paths inside this package; CUTLASS/CuTe headers come from the
installed ``nvidia-cutlass`` wheel (``cutlass_library/source/include``), never a
vendored copy. Architecture flags are explicit ``-gencode`` pairs: DeepSpeed parses
``TORCH_CUDA_ARCH_LIST`` itself and rejects ``9.0a``.
"""

import os
import shutil
from typing import List, Optional

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

# Hopper only: the kernels store into peers' memory over NVLink and use sm_90 fences, and the
# grouped GEMM uses wgmma and TMA.
GENCODE = ["-gencode=arch=compute_90a,code=sm_90a"]

# What CUTLASS/CuTe templates need from nvcc: constexpr host functions in device code, the
# half/bfloat16 operators torch's extension build switches off by default, and NDEBUG: a device
# assert is a function call inside the wgmma pipeline, which ptxas then serialises (C7510).
KERNEL_NVCC_FLAGS = [
    "-DNDEBUG",
    # Keep CUTLASS's template symbols private to this extension: torch links its own CUTLASS.
    "-Xcompiler=-fvisibility=hidden",
    "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


def kernel_sources() -> List[str]:
    """Every ``.cu`` kernel file (no torch headers needed), sorted."""
    out = []
    for root, _, files in os.walk(CSRC):
        out += [os.path.join(root, f) for f in files if f.endswith(".cu")]
    return sorted(out)


def adapter_sources() -> List[str]:
    """The torch adapters and the binding file (host compiler, torch headers)."""
    out = []
    for root, _, files in os.walk(CSRC):
        out += [os.path.join(root, f) for f in files if f.endswith(".cpp")]
    return sorted(out)


def cutlass_include() -> Optional[str]:
    """``.../cutlass_library/source/include`` of the installed wheel, or None (the grouped GEMM
    needs it; ``build_requirements`` says so). Found without importing the package, whose
    import pulls in CUTLASS's whole Python generator."""
    import importlib.util
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "source", "include")
        if os.path.isdir(os.path.join(path, "cute")):
            return path
    return None


def cxx_standard() -> str:
    """torch >= 2.12 headers need C++20 (as DeepSpeed's own builders decide)."""
    import torch
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


def find_nvcc() -> Optional[str]:
    """The nvcc DeepSpeed and torch would use: ``$CUDA_HOME/bin/nvcc``, else the PATH."""
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        CUDA_HOME = None
    if CUDA_HOME and os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


class UniEPBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_UNIEP"
    NAME = "uniep_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"ds_uniep.ops.{self.NAME}"

    def sources(self):
        return kernel_sources() + adapter_sources()

    def include_paths(self):
        paths = [CSRC]
        cutlass = cutlass_include()
        if cutlass:
            paths.append(cutlass)
        return paths

    def is_compatible(self, verbose=False):
        ok, reason = build_requirements()
        if not ok:
            self.warning(f"{self.NAME}: {reason}")
        return ok and super().is_compatible(verbose)

    def cxx_args(self):
        return ["-O3", cxx_standard(), "-Wno-reorder", "-fvisibility=hidden"]

    def nvcc_args(self):
        # No --use_fast_math: combine's fp32 sums must round exactly like the reference's.
        try:
            threads = max(1, int(os.environ.get("DS_NVCC_THREADS", "")))
        except ValueError:
            threads = min(os.cpu_count() or 1, 8)
        return ["-O3", cxx_standard(), "-lineinfo", f"--threads={threads}"] + KERNEL_NVCC_FLAGS + GENCODE


def build_requirements(device=None):
    """(ok, reason): CUDA, a Hopper GPU and nvcc, as needed to build and run the ops."""
    import torch
    if torch.version.cuda is None:
        return False, f"this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available():
        return False, "CUDA is not available (torch.cuda.is_available() is False: no GPU or driver visible)"
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return False, (f"GPU {index} ({torch.cuda.get_device_name(index)}) has compute capability {major}.{minor}; "
                       "the UniEP kernels need a Hopper GPU (9.x)")
    if find_nvcc() is None:
        return False, "nvcc was not found (set CUDA_HOME or put nvcc on the PATH)"
    if cutlass_include() is None:
        return False, "the CUTLASS/CuTe headers were not found: pip install nvidia-cutlass"
    return True, "ok"

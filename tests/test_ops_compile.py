"""Compile-only checks of the UniEP native code, for machines without a GPU.

Every ``ops/**/*.cu`` kernel file is built for sm_90a with nvcc (they need no torch
headers: that is what the launcher / adapter / binding layers buy). The torch
adapters and the binding file are parsed by the host compiler in one translation
unit, when this torch's headers allow it.
"""
import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = os.path.join(ROOT, "ops")
CSRC = os.path.join(OPS, "csrc")
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def _files(ext):
    out = []
    for root, _, files in os.walk(OPS):
        out += [os.path.join(root, f) for f in files if f.endswith(ext)]
    return sorted(out)


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_include(nvcc):
    """The CUDA toolkit's include folder (nvcc may be a wrapper script outside the toolkit)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME
        homes.append(CUDA_HOME)
    except ImportError:
        pass
    homes += [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in homes:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
            return os.path.join(home, "include")
    return None


def test_there_are_kernels():
    assert len(_files(".cu")) >= 4, "expected the layout, dispatch, combine and signal kernel files"


def test_limits_agree_with_python():
    """configs.cuh and ds_uniep/megakernel/buffers.py must agree on the limits Python validates against
    and sizes the buffers by, and on the signal phases."""
    text = open(os.path.join(CSRC, "configs.cuh")).read()

    def const(name):
        m = re.search(rf"constexpr (?:int|float) {name} = ([0-9.]+)f?;", text)
        assert m, f"{name} missing from configs.cuh"
        return float(m.group(1))

    src = open(os.path.join(ROOT, "ds_uniep", "megakernel", "buffers.py")).read()

    def py(name):
        m = re.search(rf"^{name} = (\d+)", src, re.M)
        assert m, f"{name} missing from megakernel/buffers.py"
        return float(m.group(1))

    assert const("kMaxRanks") == py("MAX_RANKS")
    assert const("kMaxExperts") == py("MAX_EXPERTS")
    assert const("kMaxTopK") == py("MAX_TOP_K")
    assert const("kFp8GroupSize") == py("FP8_GROUP")
    assert const("kErrorRecordWords") == py("ERROR_RECORD_WORDS")
    assert const("kMaxCombineChunks") == py("MAX_COMBINE_CHUNKS")
    phases = dict(re.findall(r"^\s*kPhase(\w+) = (\d+),", text, re.M))
    assert phases == {"Counts": "0", "Dispatch": "1", "Combine": "2", "Barrier": "3", "Arrived": "4", "Gates": "5"}
    assert "kNumPhases = 6" in text and py("NUM_PHASES") == 6
    types = open(os.path.join(CSRC, "types.h")).read()
    assert re.search(r"constexpr int kEpochBaseWord = (\d+);", types).group(1) == str(int(py("EPOCH_BASE_WORD")))
    for name, value in phases.items():
        assert py("PHASE_" + name.upper()) == int(value), f"PHASE_{name.upper()} differs from kPhase{name}"


def test_kernel_headers_are_torch_free():
    for path in _files(".cu") + _files(".cuh"):
        text = open(path).read()
        assert "torch/" not in text and "ATen/" not in text and "c10/" not in text, \
            f"{os.path.relpath(path, ROOT)} includes torch headers; only the adapters may"


def _builder_module():
    pytest.importorskip("deepspeed")
    sys.path.insert(0, ROOT)
    from ds_uniep._ops import ops_package
    return ops_package()


def _compile_units(sources):
    """Translation units for nvcc: the grouped GEMM instance files (one explicit instantiation each,
    of the same templates) batched into two units that ``#include`` them, which parse the CUTLASS
    headers once per unit; every other file alone. ``(label, path or None, host)``: ``host`` units
    are compiled whole (``-c``), the others device code only (``-cubin``: cicc and ptxas). Host code
    is compiled for every non-GEMM file and for the first instance of each GEMM op (the instances
    of an op differ only in their tile configuration)."""
    gemm = sorted(s for s in sources if re.search(r"grouped_gemm_[a-z]+_\d+\.cu$", s))
    first = {}
    for s in gemm:
        first.setdefault(re.search(r"grouped_gemm_([a-z]+)_\d+\.cu$", s).group(1), s)
    units = [(os.path.relpath(s, ROOT), s, True) for s in sources if s not in gemm]
    rest = [s for s in gemm if s not in first.values()]
    units.append(("GEMM instances " + ", ".join(os.path.basename(s) for s in first.values()), list(first.values()),
                  True))
    units.append(("GEMM instances " + ", ".join(os.path.basename(s) for s in rest), rest, False))
    return units


def test_nvcc_compiles_every_kernel_file():
    """All ``.cu`` files, the CUTLASS grouped GEMM instances included, with the builder's nvcc
    flags and the ``nvidia-cutlass`` wheel's headers (an install requirement, so never skipped
    for want of it): device code of every file through ptxas, host code as :func:`_compile_units`
    says."""
    ops = _builder_module()
    nvcc = ops.find_nvcc() or _nvcc()  # the nvcc the JIT build would use
    if nvcc is None:
        if os.environ.get("UNIEP_REQUIRE_NVCC"):  # CI sets it: there a missing nvcc is a failure, not a skip
            pytest.fail("nvcc not found but UNIEP_REQUIRE_NVCC is set (set CUDA_HOME or put nvcc on the PATH)")
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on the PATH)")
    # The JIT build's own nvcc flags (C++ standard, -O3, gencode, kernel flags), one nvcc thread per unit.
    flags = [f for f in ops.UniEPBuilder().nvcc_args() if not f.startswith("--threads")] + ["--threads=1"]
    assert GENCODE in flags and "-O3" in flags
    cutlass = ops.cutlass_include()
    assert cutlass is not None, "nvidia-cutlass is an install requirement but its headers were not found"
    sources = _files(".cu")
    units = _compile_units(sources)
    assert sum(len(u[1]) if isinstance(u[1], list) else 1 for u in units) == len(sources)
    with tempfile.TemporaryDirectory() as tmp:

        def build(i):
            label, src, host = units[i]
            if isinstance(src, list):  # a batch: one unit that includes the files
                path = os.path.join(tmp, f"unit{i}.cu")
                with open(path, "w") as f:
                    f.writelines(f'#include "{s}"\n' for s in src)
                src = path
            out = os.path.join(tmp, f"unit{i}" + (".o" if host else ".cubin"))
            cmd = [nvcc, *flags, "-I", CSRC, "-I", cutlass,
                   "-c" if host else "-cubin", src, "-o", out]
            r = subprocess.run(cmd, capture_output=True, text=True)
            return label, r.returncode, r.stdout + r.stderr

        # The two GEMM batches (the longest) first, so the pool ends with the short units.
        order = sorted(range(len(units)), key=lambda i: not units[i][0].startswith("GEMM"))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
            results = list(pool.map(build, order))
    failed = [f"{label}:\n{log}" for label, rc, log in results if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)
    # ptxas C7510: wgmma instructions serialised (a call inside the MMA pipeline); the grouped
    # GEMM would run far below its speed while giving the right numbers.
    serialised = [f"{label}: " + "; ".join(l for l in log.splitlines() if "C7510" in l)
                  for label, rc, log in results if "C7510" in log]
    assert not serialised, f"ptxas serialises wgmma in: {serialised}"


def test_adapters_parse_with_torch_headers():
    """The adapters and bindings, all in one translation unit (one parse of the torch headers)."""
    try:
        import torch
        from torch.utils.cpp_extension import include_paths
    except ImportError as err:
        pytest.skip(f"torch is not importable ({err})")
    cxx = shutil.which("g++") or shutil.which("c++")
    nvcc = _nvcc()
    if cxx is None:
        pytest.skip("no host C++ compiler")
    if nvcc is None:
        pytest.skip("nvcc not found, so no CUDA runtime headers for the adapters")
    cuda_inc = _cuda_include(nvcc)
    if cuda_inc is None:
        pytest.skip("no CUDA toolkit include folder with cuda_runtime_api.h found")
    incs = include_paths()
    if not any(os.path.isfile(os.path.join(p, "c10", "cuda", "CUDAStream.h")) for p in incs):
        pytest.skip("this torch ships no c10/cuda headers")
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if not any(os.path.isfile(os.path.join(p, "c10", "cuda", "impl", "cuda_cmake_macros.h")) for p in incs):
            # A CPU-only torch lacks this one generated (macro-only) header; an empty one lets
            # the adapters be parsed, which is all this check claims.
            os.makedirs(os.path.join(tmp, "c10", "cuda", "impl"))
            open(os.path.join(tmp, "c10", "cuda", "impl", "cuda_cmake_macros.h"), "w").write("#pragma once\n")
            extra = ["-I", tmp]
        unit = os.path.join(tmp, "all_adapters.cpp")
        with open(unit, "w") as f:
            for path in _files(".cpp"):
                f.write(f'#include "{path}"\n')
        cmd = [cxx, std, "-fsyntax-only", "-DTORCH_EXTENSION_NAME=uniep_ops", "-I", CSRC, "-I",
               cuda_inc, "-I", sysconfig.get_paths()["include"]] + extra
        for p in incs:
            cmd += ["-I", p]
        r = subprocess.run(cmd + [unit], capture_output=True, text=True)
    errors = [line for line in (r.stdout + r.stderr).splitlines() if "error" in line]
    assert r.returncode == 0, "host compiler failed:\n" + "\n".join(errors[:40])


def test_builder_flags():
    """The builder names absolute sources and explicit sm_90a gencode flags (no TORCH_CUDA_ARCH_LIST)."""
    ops = _builder_module()
    b = ops.UniEPBuilder()
    srcs = b.sources()
    assert srcs and all(os.path.isabs(s) and os.path.isfile(s) for s in srcs)
    assert set(_files(".cu")) <= set(srcs) and set(_files(".cpp")) <= set(srcs)
    assert GENCODE in b.nvcc_args()
    assert "--expt-relaxed-constexpr" in b.nvcc_args()
    assert ops.cutlass_include() in b.include_paths()
    assert "--use_fast_math" not in b.nvcc_args()
    ok, reason = ops.megakernel_available("cpu")
    assert not ok and reason
    import torch
    if torch.version.cuda is None:  # a CPU build of torch is named as such, not as "no GPU"
        ok, reason = ops.build_requirements()
        assert not ok and "has no CUDA" in reason, reason


def _build_outcome_body(rank, world_size, fail_rank0):
    """load_uniep_ops on 2 gloo ranks with a stand-in builder: local rank 0 builds, the other loads
    after it; where rank 0's build fails every rank gets an error and nobody builds again."""
    os.environ["LOCAL_RANK"] = str(rank)
    ops = _builder_module()
    calls = []

    class Builder:
        NAME = "uniep_ops_stand_in"

        def jit_load(self, verbose=False):
            calls.append(rank)
            if rank == 0 and fail_rank0:
                raise RuntimeError("nvcc exploded")
            return f"module on rank {rank}"

    ops.UniEPBuilder, ops.build_requirements = Builder, lambda *a: (True, "")
    # The build lock has tests of its own (test_reliability_build_lock.py): no build directory here.
    ops.build_directory, ops.build_lock = (lambda name: name), (lambda path: contextlib.nullcontext())
    ops.load_uniep_ops.cache_clear()
    if not fail_rank0:
        assert ops.load_uniep_ops() == f"module on rank {rank}" and calls == [rank]
        return
    with pytest.raises(RuntimeError, match="nvcc exploded" if rank == 0 else
                       r"building the UniEP ops failed on rank 0: RuntimeError: nvcc exploded"):
        ops.load_uniep_ops()
    assert calls == ([0] if rank == 0 else []), "a rank built after local rank 0's build failed"


@pytest.mark.parametrize("fail_rank0", [False, True])
def test_a_failed_build_on_local_rank_0_reaches_every_rank(fail_rank0):
    from dist_utils import run_distributed
    run_distributed(_build_outcome_body, 2, fail_rank0)

"""``UniEPBuilder``: DeepSpeed's JIT op builder for the UniEP CUDA kernels (sm_90a).

Sources are absolute paths inside this package; CUTLASS/CuTe headers come from the
installed ``nvidia-cutlass`` wheel (``cutlass_library/source/include``), never a
vendored copy. Architecture flags are explicit ``-gencode`` pairs: DeepSpeed parses
``TORCH_CUDA_ARCH_LIST`` itself and rejects ``9.0a``.

Build locks: torch's JIT build guards each build directory with a ``lock`` file
(``torch.utils.file_baton.FileBaton``) that only the build that made it removes; a
build killed half way leaves it behind, and every later load of that extension then
waits on it forever without a word. :func:`build_lock` serialises ds_uniep's builds
with an ``flock`` (which the kernel releases when its holder dies) and removes such
a dead build's ``lock``; :func:`stale_build_locks` lists dead builds' locks of any
extension (DeepSpeed's CPU ``shm_comm`` op included), for start-up checks.

The build output needs no rename of its own: torch builds with ninja, which writes
each output in place but records it in ``.ninja_log`` only once its command has
finished, so the next build redoes an output that a killed build left half written;
and no ds_uniep process loads the module without holding the build directory's flock
and torch's ``lock``.
"""

import contextlib
import fcntl
import glob
import os
import shutil
import socket
import sys
import time
from typing import Callable, Iterator, List, Optional, Tuple

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


# ---------------------------------------------------------------------------------------------
# Build locks
# ---------------------------------------------------------------------------------------------
TORCH_LOCK = "lock"  # torch.utils.file_baton.FileBaton's file in each extension's build directory
BUILD_FLOCK = "uniep_build.flock"  # ds_uniep's own lock beside it: "host pid" of the build holding it


def _say(message: str) -> None:
    print(f"[ds_uniep] {message}", file=sys.stderr, flush=True)


def extensions_roots() -> List[str]:
    """Folders whose subfolders are torch's JIT build directories: ``$TORCH_EXTENSIONS_DIR``, else every
    ``py*_*`` folder of torch's default root (``~/.cache/torch_extensions/py311_cu128``, ...)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return [root]
    from torch.utils.cpp_extension import get_default_build_root
    return sorted(glob.glob(os.path.join(get_default_build_root(), "py*_*")))


def build_directory(name: str) -> str:
    """torch's build directory of the extension ``name`` (created if missing), as its JIT build uses it."""
    from torch.utils.cpp_extension import _get_build_directory
    return _get_build_directory(name, False)


def lock_holders(path: str) -> Tuple[List[int], bool]:
    """``(pids, complete)``: the processes of this host that have ``path`` open (torch's FileBaton keeps its
    lock's descriptor open for as long as its build runs); ``complete`` is False where some process's
    descriptors could not be read (another user's) or there is no ``/proc``."""
    if not os.path.isdir("/proc"):
        return [], False
    target = os.path.realpath(path)
    holders, complete = [], True
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        fd_dir = os.path.join("/proc", pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:  # ended meanwhile
            continue
        except PermissionError:
            complete = False
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) == target:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    return holders, complete


def _flock_holder(build_dir: str) -> Optional[str]:
    """``"host pid"`` of a live ds_uniep build holding ``build_dir``'s flock (on any host the file system
    locks for), or None when no process holds it."""
    path = os.path.join(build_dir, BUILD_FLOCK)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def dead_lock_reason(path: str, max_age_s: float) -> Optional[str]:
    """Why ``path`` (a torch build ``lock``) is a dead build's, or None while a build may still hold it: it is
    at least ``max_age_s`` seconds old and no process of this host has it open. (A build on another host that
    shares the directory is seen by its age alone.)"""
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    if age < max_age_s:
        return None
    holders, _ = lock_holders(path)
    if holders:
        return None
    return f"{age:.0f} s old, open in no process on this host"


def stale_build_locks(max_age_s: float = 120.0, roots: Optional[List[str]] = None) -> List[str]:
    """The torch JIT build locks (``<root>/<extension>/lock``, under :func:`extensions_roots` or ``roots``)
    that builds no longer running left behind (:func:`dead_lock_reason`; a directory whose ds_uniep flock a
    live build holds is skipped). torch waits on such a file forever: it must be removed."""
    out = []
    for root in roots if roots is not None else extensions_roots():
        for path in sorted(glob.glob(os.path.join(root, "*", TORCH_LOCK))):
            if _flock_holder(os.path.dirname(path)) is None and dead_lock_reason(path, max_age_s):
                out.append(path)
    return out


def _clear_dead_lock(path: str, max_age_s: float, poll_s: float, say: Callable[[str], None]) -> None:
    """With the build directory's flock held: wait while ``path`` may be a live build's, and remove it once it
    is a dead build's (:func:`dead_lock_reason`), saying so. A lock that a process of this host holds open is
    a live build outside ds_uniep's flock: torch waits for it."""
    told = False
    while os.path.exists(path):
        reason = dead_lock_reason(path, max_age_s)
        if reason is not None:
            try:
                os.remove(path)
            except FileNotFoundError:
                return
            say(f"removed {path}: a build lock left by a build that is no longer running ({reason})")
            return
        holders, _ = lock_holders(path)
        if holders:
            return
        if not told:
            say(f"{path} is held open by no process on this host; it is removed once it is {max_age_s:.0f} s old "
                "unless its build (on another host) finishes first")
            told = True
        time.sleep(poll_s)


@contextlib.contextmanager
def build_lock(build_dir: str, max_age_s: float = 120.0, poll_s: float = 0.5,
               say: Callable[[str], None] = _say) -> Iterator[None]:
    """Hold ``build_dir``'s ds_uniep flock around a JIT build or load there.

    One holder at a time, on every host whose file system locks for ``flock``; the kernel releases it when its
    holder dies, so a killed build cannot keep it. Once held, a torch ``lock`` in the directory that no live
    build holds (left by a killed build) is removed with a message naming it. Waiting for another live build
    is said once after 30 s, naming its host and pid."""
    os.makedirs(build_dir, exist_ok=True)
    fd = os.open(os.path.join(build_dir, BUILD_FLOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and time.monotonic() - start > 30:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
                    say(f"waiting for the build in {build_dir} (held by host/pid {holder})")
                    told = True
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
        _clear_dead_lock(os.path.join(build_dir, TORCH_LOCK), max_age_s, poll_s, say)
        yield
    finally:
        os.close(fd)  # releases the flock

import functools
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

#: The files that take longest on a CPU machine, collected first so that ``pytest -n 2 --dist
#: loadfile`` starts them on separate workers instead of leaving one of them for the end.
LONGEST_FILES = ("test_ops_compile.py", "test_hybrid_runtime.py", "test_benchmarks_cli.py",
                 "test_gpt_moe_training.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))
    # ``-m gpu`` selects the tests that need GPUs: those under needs_gpus (below).
    for item in items:
        if any(m.kwargs.get("reason", "").startswith(_GPU_REASONS) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)



def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


# DeepSpeed picks its accelerator once per process; spawned ranks inherit this.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")


def cuda_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


_GPU_REASONS = ("ranks share the visible GPUs", "needs GPUs: ")


def needs_gpus(n: int):
    """Skip (with the reason) unless ``n`` CUDA GPUs are present; such tests carry the ``gpu`` marker."""
    have = cuda_gpus()
    from dist_utils import shared_gpus
    if shared_gpus() and have:
        return pytest.mark.skipif(False, reason=_GPU_REASONS[0])
    return pytest.mark.skipif(have < n, reason=f"{_GPU_REASONS[1]}{n} CUDA GPU(s), found {have}")


_SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce leaves a shared-memory buffer per run in /dev/shm; launched examples
    and spawned ranks would otherwise pile them up until the machine runs out of memory. Only buffers
    that no live process uses go: another test process's run opens its peers' buffers by name, and a
    rank that finds one gone spins forever."""
    import glob

    from dist_utils import remove_unused_shm_buffers
    before = set(glob.glob(_SHM_PATTERN))
    yield
    remove_unused_shm_buffers(set(glob.glob(_SHM_PATTERN)) - before)


@functools.lru_cache(maxsize=None)
def cpu_gemm_blocks_exact() -> bool:
    """Whether this machine's CPU GEMM gives a block of rows the bits those rows get inside a larger
    matrix (fp32 and bf16, at the CPU tests' sizes). The fused CommFuse forms multiply blocks and are
    bit for bit the unfused ones only where it does; some CPU GEMM libraries round a row by how many
    rows they are given (seen with MKL on AMD EPYC), and there the tests check within rounding."""
    import torch
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for K, N in ((8, 7), (16, 24), (24, 32), (32, 48), (64, 96), (37, 29)):
            a = torch.randn(24, K, generator=g).to(dtype)
            w = torch.randn(K, N, generator=g).to(dtype)
            full = a @ w
            for r0, r1 in ((0, 1), (0, 3), (3, 8), (5, 24), (6, 18), (1, 11)):
                if not torch.equal(a[r0:r1] @ w, full[r0:r1]):
                    return False
    return True


def assert_matches(got, want, tag: str, exact: bool = True) -> bool:
    """``exact``: bit for bit. Otherwise within the rounding of summing in another order, relative to the
    largest magnitude (fp32/fp64 1e-4, 16-bit types 2e-2); returns whether the bits were equal as well."""
    import torch
    assert got.shape == want.shape and got.dtype == want.dtype, f"{tag}: {got.dtype} {tuple(got.shape)} " \
        f"given, {want.dtype} {tuple(want.shape)} expected"
    if torch.equal(got, want):
        return True
    err = (got.float() - want.float()).abs().max().item()
    assert not exact, f"{tag} differs: max |difference| {err}"
    tol = 1e-4 if want.dtype in (torch.float32, torch.float64) else 2e-2
    scale = max(want.float().abs().max().item(), 1e-30)
    assert err <= tol * scale, f"{tag} differs by {err}, more than {tol} x the largest magnitude {scale}"
    return False


def report_bitwise(rank: int, what: str, flags) -> None:
    """Rank 0 prints how many of the cases checked within rounding had the reference's bits as well."""
    if rank == 0:
        print(f"{what}: {sum(flags)} of {len(flags)} cases bit for bit, the rest within rounding", flush=True)


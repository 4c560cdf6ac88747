"""Start-up checks and error exits shared by the examples' ``train.py`` scripts.

A bad ``"uniep"`` block or a build lock left by a killed build is every rank's problem
alike: the job then ends at once, every rank with a non-zero exit code, and the
reason is one line on stderr from one rank, not a traceback from each.
"""
import importlib.util
import os
import sys
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The variables launchers set for a process's global and node-local rank, in the order they are read:
# deepspeed and torchrun (RANK, LOCAL_RANK), Open MPI, MPICH's hydra (PMI_*, MPI_LOCALRANKID), Slurm.
RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

# A torch build lock this old and open in no process of this host is a killed build's.
STALE_LOCK_AGE_S = 120.0


def _env_rank(names) -> int:
    for name in names:
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def launch_rank() -> int:
    """This process's global rank: torch.distributed's once it has started, else the launcher's variables."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return _env_rank(RANK_VARS)


def local_rank() -> int:
    """This process's rank on its node, from the launcher's variables (0 when none is set)."""
    return _env_rank(LOCAL_RANK_VARS)


def one_line(message: str) -> str:
    """``message`` on one line: ``"head:\\n  a\\n  b"`` becomes ``"head: a; b"``."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return ""
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {'; '.join(lines[1:])}"
    return "; ".join(lines)


SILENT_EXIT_DELAY_S = 2.0


def fail(message: str, code: int = 2, speak: Optional[bool] = None) -> None:
    """Leave now with ``code``; ``message`` goes to stderr as one line where ``speak`` (default: on global
    rank 0). No exit handlers or destructors run: a process group's teardown can wait on peers that are gone,
    and every rank reaches this on its own, so none waits for another."""
    if speak is None:
        speak = launch_rank() == 0
    if speak:
        print(f"error: {one_line(message)}", file=sys.stderr, flush=True)
    else:
        # A launcher stops every rank as soon as one exits: the silent ranks leave a moment later,
        # so that the speaking rank's line is out first.
        time.sleep(SILENT_EXIT_DELAY_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _ops_builder():
    """ds_uniep's ops builder module (``ds_uniep.ops.builder``; ``ops/builder.py`` of this checkout when
    ds_uniep is not installed)."""
    try:
        from ds_uniep.ops import builder
        return builder
    except ImportError:
        path = os.path.join(REPO, "ops", "builder.py")
        spec = importlib.util.spec_from_file_location("uniep_ops_builder", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def check_build_locks(max_age_s: float = STALE_LOCK_AGE_S) -> None:
    """Stop (exit code 2) when torch's extension directory holds a build lock left by a killed build: the next
    load of that extension (DeepSpeed's CPU ``shm_comm`` op in ``deepspeed.init_distributed``, any JIT op)
    would wait on it forever without a word. Local rank 0 of each node names the files to remove."""
    stale = _ops_builder().stale_build_locks(max_age_s)
    if stale:
        fail(f"torch build lock(s) left by builds that are no longer running (older than {max_age_s:.0f} s, open "
             f"in no process on this host): torch would wait on them forever; remove them: rm {' '.join(stale)}",
             speak=local_rank() == 0)


def run(main) -> None:
    """The examples' ``__main__``: ``ds_uniep.backend.run_script(main)``, and a ``UniEPConfigError`` (a bad
    ``"uniep"`` block: the same on every rank) ends the job with one line from rank 0 and exit code 2."""
    from ds_uniep.backend import run_script
    from ds_uniep.config import UniEPConfigError

    def guarded():
        try:
            main()
        except UniEPConfigError as err:
            fail(str(err))

    run_script(guarded)

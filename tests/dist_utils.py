"""Run a test body on N ranks in spawned processes (gloo on CPU, NCCL on GPU).

Every rank's exit code is asserted and a failing rank's traceback is re-raised
in the parent, so a test cannot pass because a rank died quietly. A run fails
fast: at the first failing rank the others are killed; collectives time out;
and a run that passes its time limit is stopped with every live rank's Python
stack (where each one waits) in the failure's message.
"""
import datetime
import faulthandler
import glob
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def shared_gpus() -> bool:
    """``UNIEP_TEST_SHARED_GPUS=1``: the GPU tests' ranks share the visible GPUs round-robin (ranks on
    one GPU run time-sliced) and talk over gloo instead of NCCL. Checks correctness with more ranks
    than GPUs; timings taken this way mean nothing."""
    return os.environ.get("UNIEP_TEST_SHARED_GPUS", "0") == "1"


def rank_gpu(rank: int):
    """The GPU of ``rank`` in a GPU test (``cuda:rank``, or round-robin under :func:`shared_gpus`)."""
    import torch
    return torch.device("cuda", rank % torch.cuda.device_count() if shared_gpus() else rank)


def free_port() -> int:
    """A port free now, for launchers that bind it themselves (``deepspeed --master_port``,
    ``torchrun``); another process can take it before they do, which run_distributed avoids and
    :func:`run_launcher` retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What launchers print when the rendezvous port was taken between free_port() and their bind.
PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def run_launcher(command, env=None, attempts: int = 3, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command(port), env=env(port), capture_output=True, text=True, **kwargs)``
    on a port from :func:`free_port` (``env`` None: this process's environment); launched again on a
    new port (at most ``attempts`` times in all) when it failed because another process took that
    port first. Any other outcome is returned as it is."""
    def launch():
        port = free_port()
        return subprocess.run(command(port), env=None if env is None else env(port), capture_output=True,
                              text=True, **kwargs)

    for _ in range(attempts - 1):
        proc = launch()
        if proc.returncode == 0 or not any(m in proc.stdout + proc.stderr for m in PORT_TAKEN):
            return proc
    return launch()


def _entry(rank, world_size, port, backend, fn, args, report_dir, collective_timeout, environ):
    # A rank forked from the fork server has the server's environment: the caller's, now.
    os.environ.clear()
    os.environ.update(environ)
    # The parent holds the rendezvous store on ``port`` (see run_distributed): every rank is a client.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    # SIGUSR1 writes this rank's Python stacks (all threads) to a file: the parent asks for them when the run
    # passes its time limit, to say where each rank waits (even inside C++, e.g. a spin on a peer).
    stacks = open(os.path.join(report_dir, f"rank{rank}.stack"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # CPU ranks: one intra-op thread each unless the caller chose otherwise, as torchrun does; ranks
    # that each start a thread per core oversubscribe the cores (a 4-rank step on 2 cores took 7-12x
    # longer). GPU (NCCL) ranks keep torch's default.
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1") if backend != "nccl" else None
    if backend != "nccl":
        # CPU ranks run DeepSpeed on its CPU accelerator even where GPUs are visible: with the CUDA one an
        # engine binds GPU ``rank``, which does not exist when the ranks outnumber the GPUs.
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
        import torch
        if threads and threads.isdigit() and int(threads) > 0:  # torch may be imported already (this module)
            torch.set_num_threads(int(threads))
        timeout = datetime.timedelta(seconds=collective_timeout)
        if backend == "nccl" and shared_gpus():
            # Ranks time-share the visible GPUs (see shared_gpus); NCCL refuses two ranks on one GPU.
            torch.cuda.set_device(rank_gpu(rank))
            backend = "gloo"
            torch.distributed.init_process_group(backend, timeout=timeout)
        elif backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # DeepSpeed binds a CUDA device whenever one is visible, and torch then builds every
            # new_group() by splitting, which gloo groups cannot do: start gloo unbound here.
            torch.distributed.init_process_group(backend, timeout=timeout)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, timeout=timeout)
        fn(rank, world_size, *args)
        import deepspeed.comm as dist
        dist.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        # One file per rank, complete once renamed: a rank killed while reporting leaves nothing half written.
        path = os.path.join(report_dir, f"rank{rank}.error")
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)
        raise
    # Every rank finished and met the others at the barrier. Leave without running C++ static
    # destructors: a background thread of the communication stack can end the process with
    # "terminate called without an active exception" (SIGABRT) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _errors(report_dir):
    """``[(time, rank, traceback)]`` of the ranks that reported an error, the earliest first."""
    out = []
    for path in glob.glob(os.path.join(report_dir, "rank*.error")):
        with open(path) as f:
            when, _, tb = f.read().partition("\n")
        out.append((float(when), int(os.path.basename(path)[4:-len(".error")]), tb))
    return sorted(out)


def _stacks(procs, report_dir, alive):
    """The Python stacks of the ranks in ``alive``, asked for by SIGUSR1 (see _entry)."""
    for r in alive:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)
    out = []
    for r in alive:
        try:
            with open(os.path.join(report_dir, f"rank{r}.stack")) as f:
                text = f.read().strip()
        except OSError:
            text = ""
        out.append(f"--- rank {r} ---\n{text or '(no stack: the rank had not started Python code yet)'}")
    return "\n".join(out)


def _stale_locks_note() -> str:
    """Names the torch build locks that dead builds left (a rank loading that op waits forever), if any."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ops", "builder.py")
    try:
        spec = importlib.util.spec_from_file_location("uniep_ops_builder", path)
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        stale = builder.stale_build_locks(120.0)
    except Exception:  # noqa: BLE001 - a note only
        return ""
    return (f"\ntorch build locks left by builds no longer running (a JIT load waits on them forever): "
            f"{', '.join(stale)}") if stale else ""


#: What the CPU ranks' fork server imports once, so that each rank starts without importing them
#: again (seconds of CPU per rank; ds_uniep's ``torch.compiler.disable`` imports ``torch._dynamo``,
#: the Hugging Face tests ``transformers``; a module that cannot be imported is skipped). Not
#: ds_uniep: it reads its environment variables at import.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "deepspeed", "deepspeed.comm", "transformers"]


_OPS_BUILT = False


def _build_cpu_comm_op() -> None:
    """Build DeepSpeed's CPU communication op (``deepspeed.init_distributed`` loads it in every
    gloo rank) here, once, before the first ranks start: a rank stopped by its time limit in the
    middle of that build would leave torch's build lock behind, and every later load would wait on
    it. Whatever fails here is left for the ranks to meet and report."""
    global _OPS_BUILT
    if _OPS_BUILT:
        return
    _OPS_BUILT = True
    try:
        from deepspeed.comm.torch import build_shm_op
        build_shm_op()
    except Exception:  # noqa: BLE001 - the ranks build (or fail to) as they would without this
        pass


def _context(backend: str):
    """Ranks fork from a server that has imported :data:`PRELOAD` on machines without CUDA; where
    CUDA is (NCCL ranks, and gloo ranks on a machine with GPUs), they are spawned fresh: a process
    that forks must not have touched the CUDA driver, which importing DeepSpeed does."""
    import torch
    if backend == "nccl" or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 600.0):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (forked from a fork
    server, or spawned: :func:`_context`), each with this process's environment.

    Fails (AssertionError) with the first failing rank's traceback as soon as one rank fails (the others are
    killed), with the exit codes when a rank died without a Python error (a signal), and, after ``timeout``
    seconds, with the ranks still running and their Python stacks. Collectives time out after
    ``0.8 * timeout`` seconds, so a rank waiting on a peer that never comes reports its own traceback."""
    if backend != "nccl":
        _build_cpu_comm_op()
    ctx = _context(backend)
    report_dir = tempfile.mkdtemp(prefix="run_distributed_")
    # The rendezvous store lives here, on a port the OS picks and this process keeps bound until the
    # ranks are done (the ranks connect as clients, as under torchrun's agent), so no other process
    # can take the port between its choice and the ranks' start.
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    collective_timeout = max(10.0, 0.8 * timeout)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, report_dir,
                                              collective_timeout, dict(os.environ))) for r in range(world_size)]
    for p in procs:
        p.start()
    # A rank that fails leaves its peers blocked in their next collective: stop them all
    # at the first failure instead of waiting for the peers' collective timeouts.
    start = time.monotonic()
    deadline = start + timeout
    failed = False
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if _errors(report_dir) or any(p.exitcode not in (None, 0) for p in procs):
            failed = True
            time.sleep(2.0)  # let the failing rank finish reporting
            break
        time.sleep(0.05)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    hang = ""
    if alive and not failed and not _errors(report_dir):
        hang = (f"ranks {alive} of {world_size} still running after {time.monotonic() - start:.0f} s "
                f"(timeout {timeout:.0f} s); where each waits:\n{_stacks(procs, report_dir, alive)}"
                f"{_stale_locks_note()}")
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=30)
    # DeepSpeed's CPU all-reduce keeps shared-memory buffers named after the master port; a run
    # that ends leaves them in /dev/shm, and enough of them fill the machine's memory.
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass
    errors = _errors(report_dir)
    for path in glob.glob(os.path.join(report_dir, "*")):
        try:
            os.remove(path)
        except OSError:
            pass
    try:
        os.rmdir(report_dir)
    except OSError:
        pass
    codes = [p.exitcode for p in procs]
    # Ranks that died without a Python error (a signal, os._exit): the likely root cause when a peer's error
    # is only its lost connection to them. Ranks this function killed are not among them.
    reported = {rank for _, rank, _ in errors}
    silent = [f"rank {r} of {world_size} exit code {c}" + (f" (signal {-c})" if c is not None and c < 0 else "")
              + " without a Python error" for r, c in enumerate(codes)
              if c != 0 and r not in reported and r not in alive]
    if errors:
        # The first report is the root cause; later ones are peers losing their connection to it.
        _, rank, tb = errors[0]
        killed = f" (ranks {alive} were still running and were killed)" if alive else ""
        raise AssertionError("".join(line + "\n" for line in silent) + f"rank {rank} of {world_size} failed"
                             f"{killed}:\n{tb}")
    if hang:
        raise AssertionError(hang)
    assert not silent, "; ".join(silent) + (f"; ranks {alive} still running then were killed" if alive else "")


# DeepSpeed's CPU all-reduce's shared-memory buffers (one per rank, named after the run's master port).
SHM_PATTERN = "/dev/shm/deepspeed_allreduce_buffer_*"


def shm_in_use(paths):
    """The ``paths`` that a live process of this host has open or mapped."""
    paths = set(paths)
    used = set()
    if not paths or not os.path.isdir("/proc"):
        return used
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(maxsplit=5)  # address perms offset dev inode [path]
                    path = fields[5] if len(fields) == 6 else ""
                    path = path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path
                    if path in paths:
                        used.add(path)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link in paths:
                    used.add(link)
        except OSError:  # ended meanwhile, or another user's
            continue
    return used


def remove_unused_shm_buffers(paths):
    """Remove those of ``paths`` (DeepSpeed's shared-memory buffers) that no live process has open or mapped.
    A buffer of a run still going on (another test process's) stays: its peers open it by name, and a
    peer that finds it gone waits forever."""
    paths = set(paths)
    for path in paths - shm_in_use(paths):
        try:
            os.remove(path)
        except OSError:
            pass

"""Run a test body on N ranks in spawned processes (gloo on CPU, NCCL on GPU).

Every rank's exit code is asserted and a failing rank's traceback is re-raised
in the parent, so a test cannot pass because a rank died quietly.
"""
import glob
import os
import socket
import subprocess
import sys
import time
import traceback

import torch.multiprocessing as mp


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


def _entry(rank, world_size, port, backend, fn, args, errq):
    # The parent holds the rendezvous store on ``port`` (see run_distributed): every rank is a client.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    # CPU ranks: one intra-op thread each unless the caller chose otherwise, as torchrun does; ranks
    # that each start a thread per core oversubscribe the cores (a 4-rank step on 2 cores took 7-12x
    # longer). GPU (NCCL) ranks keep torch's default.
    threads = os.environ.setdefault("OMP_NUM_THREADS", "1") if backend != "nccl" else None
    try:
        import deepspeed
        import torch
        if threads and threads.isdigit() and int(threads) > 0:  # torch may be imported already (this module)
            torch.set_num_threads(int(threads))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # DeepSpeed binds a CUDA device whenever one is visible, and torch then builds every
            # new_group() by splitting, which gloo groups cannot do: start gloo unbound here.
            torch.distributed.init_process_group(backend)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        fn(rank, world_size, *args)
        import deepspeed.comm as dist
        dist.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        errq.put((rank, traceback.format_exc()))
        raise
    # Every rank finished and met the others at the barrier. Leave without running C++ static
    # destructors: a background thread of the communication stack can end the process with
    # "terminate called without an active exception" (SIGABRT) after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 600.0):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes."""
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    # The rendezvous store lives here, on a port the OS picks and this process keeps bound until the
    # ranks are done (the ranks connect as clients, as under torchrun's agent), so no other process
    # can take the port between its choice and the ranks' start.
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, errq)) for r in range(world_size)]
    for p in procs:
        p.start()
    # A rank that fails leaves its peers blocked in their next collective: stop them all
    # at the first failure instead of waiting for the peers' collective timeouts.
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if not errq.empty() or any(p.exitcode not in (None, 0) for p in procs):
            time.sleep(2.0)  # let the failing rank finish reporting
            break
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    # DeepSpeed's CPU all-reduce keeps shared-memory buffers named after the master port; a run
    # that ends leaves them in /dev/shm, and enough of them fill the machine's memory.
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    if errors:
        # The first report is the root cause; later ones are peers losing their connection to it.
        rank, tb = errors[0]
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{tb}")
    codes = [p.exitcode for p in procs]
    assert all(c == 0 for c in codes), f"rank exit codes {codes} (a negative code is a signal; None a hang)"

"""JIT build locks: a killed build cannot keep its lock, two builds take turns, start-up names dead locks.

torch guards each extension's build directory with a ``lock`` file that only the build that made it
removes; these tests kill builds half way (whole process groups, as a dying machine job would be) and
check that the next build removes the dead build's lock, saying which file, and redoes the output.
The builds are stand-ins (torch's FileBaton and ninja with a slow rule, as torch's JIT build runs
them); nothing is compiled.
"""
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILDER = os.path.join(REPO, "ops", "builder.py")
NINJA = shutil.which("ninja") or os.path.join(os.path.dirname(sys.executable), "ninja")


def _builder():
    spec = importlib.util.spec_from_file_location("uniep_ops_builder_test", BUILDER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A stand-in for torch's JIT build (torch.utils.cpp_extension._jit_compile): take the FileBaton, run
# ninja in the build directory, release; under ds_uniep's build_lock, as load_uniep_ops runs it.
BUILD_SCRIPT = f"""
import importlib.util, os, subprocess, sys
from torch.utils.file_baton import FileBaton
spec = importlib.util.spec_from_file_location("b", {BUILDER!r})
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
build_dir = sys.argv[1]
with b.build_lock(build_dir, max_age_s=float(sys.argv[2]), poll_s=0.1):
    baton = FileBaton(os.path.join(build_dir, "lock"))
    if baton.try_acquire():
        try:
            subprocess.run([{NINJA!r}], cwd=build_dir, check=True, stdout=subprocess.DEVNULL)
        finally:
            baton.release()
    else:
        baton.wait()
print("built", flush=True)
"""

NINJA_FILE = """rule slow
  command = sh -c 'echo half > $out; sleep $${SLEEP:-0}; echo whole >> $out'
build ext.so: slow src.txt
"""


def _build_dir(tmp_path):
    root = tmp_path / "torch_extensions"
    build_dir = root / "fake_ext"
    build_dir.mkdir(parents=True)
    (build_dir / "build.ninja").write_text(NINJA_FILE)
    (build_dir / "src.txt").write_text("source\n")
    return str(root), str(build_dir)


def _start_build(build_dir, sleep, max_age_s=0.0):
    env = dict(os.environ, SLEEP=str(sleep))
    return subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, build_dir, str(max_age_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.exists(NINJA), reason="needs ninja (torch's JIT builds run it)")
def test_a_build_killed_half_way_leaves_a_lock_the_next_build_removes(tmp_path):
    b = _builder()
    root, build_dir = _build_dir(tmp_path)
    out, lock = os.path.join(build_dir, "ext.so"), os.path.join(build_dir, "lock")
    first = _start_build(build_dir, sleep=60)
    try:
        _wait_for(lambda: os.path.exists(out) and open(out).read() == "half\n", 60, "the build's first half")
        os.killpg(first.pid, signal.SIGKILL)  # the build, its ninja and ninja's command, at once
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert os.path.exists(lock) and open(out).read() == "half\n"
    # Nothing holds the lock now: it is a dead build's, listed once old enough.
    assert b.stale_build_locks(max_age_s=0, roots=[root]) == [lock]
    assert b.stale_build_locks(max_age_s=3600, roots=[root]) == []

    said = []
    start = time.monotonic()
    with b.build_lock(build_dir, max_age_s=1.0, poll_s=0.05, say=said.append):
        assert not os.path.exists(lock)
        proc = subprocess.run([NINJA], cwd=build_dir, capture_output=True, text=True, env=dict(os.environ, SLEEP="0"))
    assert time.monotonic() - start < 20
    assert any(f"removed {lock}" in m and "no longer running" in m for m in said), said
    # ninja redoes the output whose command never finished (no .ninja_log entry): the output is whole.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert open(out).read() == "half\nwhole\n", proc.stdout
    assert b.stale_build_locks(max_age_s=0, roots=[root]) == []


@pytest.mark.skipif(not os.path.exists(NINJA), reason="needs ninja (torch's JIT builds run it)")
def test_a_killed_build_does_not_keep_the_next_process_waiting(tmp_path):
    """The next build (another process, as the next launch) goes through build_lock and finishes."""
    root, build_dir = _build_dir(tmp_path)
    out = os.path.join(build_dir, "ext.so")
    first = _start_build(build_dir, sleep=60)
    try:
        _wait_for(lambda: os.path.exists(out) and open(out).read() == "half\n", 60, "the build's first half")
        second = _start_build(build_dir, sleep=0, max_age_s=1.0)  # waits on the first build's flock
        time.sleep(1.0)
        assert second.poll() is None
        os.killpg(first.pid, signal.SIGKILL)
        stdout, stderr = second.communicate(timeout=60)
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert second.returncode == 0 and "built" in stdout, stderr
    assert f"removed {os.path.join(build_dir, 'lock')}" in stderr, stderr
    assert open(out).read() == "half\nwhole\n"


def test_two_builds_at_once_take_turns(tmp_path):
    _, build_dir = _build_dir(tmp_path)
    log = tmp_path / "turns.txt"
    script = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("b", {BUILDER!r})
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
with b.build_lock({build_dir!r}, poll_s=0.05):
    with open({str(log)!r}, "a") as f:
        f.write(f"start {{os.getpid()}}\\n")
    time.sleep(1.5)
    with open({str(log)!r}, "a") as f:
        f.write(f"end {{os.getpid()}}\\n")
"""
    procs = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    lines = log.read_text().split()
    events = list(zip(lines[0::2], lines[1::2]))
    assert [e for e, _ in events] == ["start", "end", "start", "end"], events
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1] != events[0][1], events


def test_a_lock_held_open_by_a_live_process_is_not_stale(tmp_path):
    b = _builder()
    root, build_dir = _build_dir(tmp_path)
    lock = os.path.join(build_dir, "lock")
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; fd = os.open(sys.argv[1], "
                               "os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(120)", lock],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.utime(lock, (time.time() - 3600, time.time() - 3600))  # an hour old, but its build runs
        assert b.lock_holders(lock)[0] == [holder.pid]
        assert b.stale_build_locks(max_age_s=60, roots=[root]) == []
    finally:
        holder.kill()
        holder.wait()
    assert b.lock_holders(lock)[0] == []
    assert b.stale_build_locks(max_age_s=60, roots=[root]) == [lock]
    # A fresh lock of no process may be a build on another host that shares the directory: not yet stale.
    os.utime(lock, None)
    assert b.stale_build_locks(max_age_s=60, roots=[root]) == []


def test_a_directory_under_a_live_builds_flock_is_not_reported(tmp_path):
    b = _builder()
    root, build_dir = _build_dir(tmp_path)
    lock = os.path.join(build_dir, "lock")
    open(lock, "w").close()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    script = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
              "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'otherhost 7'); print('held', flush=True); "
              "time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", script, os.path.join(build_dir, b.BUILD_FLOCK)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert b.stale_build_locks(max_age_s=60, roots=[root]) == []
    finally:
        holder.kill()
        holder.wait()
    assert b.stale_build_locks(max_age_s=60, roots=[root]) == [lock]


@pytest.mark.parametrize("rank", [0, 1])
def test_examples_start_up_names_a_dead_builds_lock_and_stops(rank, tmp_path):
    """What the examples run before deepspeed.init_distributed (whose CPU shm_comm op load would wait on a
    dead lock in its build directory forever)."""
    root = tmp_path / "torch_extensions"
    (root / "deepspeed_shm_comm").mkdir(parents=True)
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.write_text("")
    os.utime(lock, (time.time() - 600, time.time() - 600))
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), RANK=str(rank), LOCAL_RANK=str(rank),
               DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([os.path.join(REPO, "examples"), REPO]))
    proc = subprocess.run([sys.executable, "-c", "import launch_utils; launch_utils.check_build_locks(); "
                           "print('started')"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "started" not in proc.stdout, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if rank == 0:
        assert len(errors) == 1 and f"rm {lock}" in errors[0], proc.stderr
    else:
        assert errors == [], proc.stderr
    # Without the dead lock, start-up goes on.
    lock.unlink()
    proc = subprocess.run([sys.executable, "-c", "import launch_utils; launch_utils.check_build_locks(); "
                           "print('started')"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr

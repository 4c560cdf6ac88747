"""The examples run with 2 ranks under each launcher DeepSpeed users have: deepspeed, torchrun, mpirun.

CPU commands that work (from the repository root; DS_ACCELERATOR=cpu is optional on a
machine without GPUs, DeepSpeed picks its CPU accelerator by itself):

    deepspeed --num_gpus 2 examples/gpt_moe/train.py --moe-expert-parallel-size 2 ...
    torchrun --nproc_per_node 2 examples/gpt_moe/train.py --moe-expert-parallel-size 2 ...
    MASTER_PORT=29500 mpirun -np 2 python examples/gpt_moe/train.py --moe-expert-parallel-size 2 ...

Under mpirun, ``deepspeed.init_distributed`` finds no RANK/WORLD_SIZE and discovers them
through mpi4py (MPICH's hydra sets PMI_RANK, PMI_SIZE, MPI_LOCALRANKID); it sets MASTER_ADDR
to rank 0's host address and MASTER_PORT to the ``distributed_port`` the script passes
(the examples pass $MASTER_PORT, default 29500).
"""
import os
import shlex
import sys

import pytest

from dist_utils import run_launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(REPO, "examples", "gpt_moe", "train.py")
CIFAR = os.path.join(REPO, "examples", "cifar10_moe", "train.py")
BIN = os.path.dirname(sys.executable)
CONFIGS = os.path.join(REPO, "configs")
GPT_TINY = ["--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--train-iters", "6",
            "--eval-interval", "3", "--eval-iters", "2", "--log-interval", "0", "--corpus-max-bytes", "200000"]




def _env(**extra):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    # Appended, not prepended: the ninja found first on PATH decides whether DeepSpeed's
    # cached CPU comm op is reused or rebuilt, so keep the one this pytest process sees.
    env["PATH"] = os.pathsep.join(p for p in (env.get("PATH"), BIN) if p)
    return env


def _run(cmd, env=None, timeout=240):
    """``cmd(port)`` (and ``env(port)``, default :func:`_env`) launched on a free rendezvous port,
    again on another one if that port was taken meanwhile -> (process, log)."""
    proc = run_launcher(cmd, env=env or (lambda port: _env()), cwd=REPO, timeout=timeout)
    return proc, f"exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def _final_line(out: str, tag: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(tag)]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_gpt_under_deepspeed_launcher():
    proc, log = _run(lambda port: [
        os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(port), GPT, *GPT_TINY,
        "--deepspeed_config", os.path.join(CONFIGS, "ds_config_cpu_zero2.json"),
        "--num-experts", "4", "--topk", "2", "--moe-expert-parallel-size", "2",
        "--create-moe-param-group", "--backend", "reference"])
    assert proc.returncode == 0, log
    line = _final_line(proc.stdout, "[gpt_moe] final:")
    assert "backend=reference ranks=2 steps=1-6" in line and "tokens/s=" in line, line
    assert "held-out loss" in proc.stdout


def test_gpt_under_torchrun_with_stock_moe():
    proc, log = _run(lambda port: [
        os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), GPT, *GPT_TINY,
        "--deepspeed_config", os.path.join(CONFIGS, "ds_config_cpu_zero0.json"),
        "--num-experts", "2", "--moe-expert-parallel-size", "2", "--create-moe-param-group",
        "--backend", "deepspeed"])
    assert proc.returncode == 0, log
    assert "backend=deepspeed ranks=2" in _final_line(proc.stdout, "[gpt_moe] final:")


def test_gpt_under_mpirun_pr_moe_dropless():
    # PR-MoE: 4 blocks, MoE in blocks 2 and 4 with 2 and 4 experts, residual MLP, no token dropping.
    proc, log = _run(lambda port: [
        os.path.join(BIN, "mpirun"), "-np", "2", sys.executable, GPT, *GPT_TINY,
        "--deepspeed_config", os.path.join(CONFIGS, "ds_config_cpu_zero0.json"),
        "--num-layers", "4", "--num-experts", "2", "4", "--mlp-type", "residual",
        "--disable-moe-token-dropping", "--moe-expert-parallel-size", "2", "--create-moe-param-group",
        "--backend", "reference"], env=lambda port: _env(MASTER_PORT=str(port)))
    assert proc.returncode == 0, log
    assert "experts/block=[1, 2, 1, 4]" in proc.stdout, log
    assert "backend=reference ranks=2" in _final_line(proc.stdout, "[gpt_moe] final:")


def test_gpt_under_two_torchrun_nodes_is_bitwise_one_node(tmp_path):
    """Two ``torchrun --nnodes 2`` agents of 2 ranks rendezvousing on localhost, as on two hosts: the
    layer takes the node size from torchrun's local world size and runs the two-level transport; the
    losses equal those of one 4-rank torchrun (one node, the flat exchange) bit for bit."""
    args = [GPT, *GPT_TINY, "--deepspeed_config", os.path.join(CONFIGS, "ds_config_cpu_zero0.json"),
            "--num-experts", "8", "--topk", "2", "--moe-expert-parallel-size", "4", "--create-moe-param-group",
            "--backend", "reference"]
    torchrun = os.path.join(BIN, "torchrun")
    one, log = _run(lambda port: [torchrun, "--nproc_per_node", "4", "--master_addr", "127.0.0.1", "--master_port",
                                  str(port), *args, "--loss-log", str(tmp_path / "one.json")])
    assert one.returncode == 0, log
    def agents(port):
        return " & ".join(shlex.join([torchrun, "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(n),
                                      "--master_addr", "127.0.0.1", "--master_port", str(port), *args,
                                      "--loss-log", str(tmp_path / "two.json")]) for n in (0, 1))
    two, log = _run(lambda port: ["bash", "-c", agents(port) + " & wait -n && wait -n"])
    assert two.returncode == 0, log
    assert "two-level" in two.stdout + two.stderr and "two-level" not in one.stdout + one.stderr, log
    assert "ranks=4 steps=1-6" in _final_line(two.stdout, "[gpt_moe] final:")
    assert (tmp_path / "two.json").read_text() == (tmp_path / "one.json").read_text()


def test_cifar_under_deepspeed_launcher():
    proc, log = _run(lambda port: [
        os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(port), CIFAR,
        "--moe", "--ep-world-size", "2", "--num-experts", "2", "--top-k", "1",
        "--noisy-gate-policy", "RSample", "--moe-param-group", "--mlp-type", "residual",
        "--stage", "2", "--dtype", "fp32", "--steps", "8", "--log-interval", "4",
        "--backend", "reference"])
    assert proc.returncode == 0, log
    assert "training on scikit-learn's bundled digits" in proc.stdout or "CIFAR-10 from" in proc.stdout, log
    line = _final_line(proc.stdout, "[cifar10_moe] final:")
    assert "backend=reference steps=8" in line and "test_accuracy=" in line, line
    assert "dtype=fp32 zero=2 batch=16" in proc.stdout, log  # what the engine runs


def test_cifar_refuses_flags_its_config_file_would_override(capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location("cifar_train", CIFAR)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    cfg = os.path.join(REPO, "configs", "ds_config_cpu_zero2.json")
    with pytest.raises(SystemExit) as e:
        train.add_argument(["--deepspeed_config", cfg, "--stage", "0", "--batch_size", "4"])
    assert e.value.code == 2
    assert "--batch_size, --stage cannot be combined with --deepspeed_config" in capsys.readouterr().err
    args = train.add_argument(["--deepspeed_config", cfg])
    assert train.get_ds_config(args)["zero_optimization"]["stage"] == 2
    args = train.add_argument([])
    assert (args.batch_size, args.stage) == (16, 0)


def test_megakernel_backend_on_cpu_fails_with_the_layer_error():
    # One rank, no launcher: the error comes from UniEPMoE's constructor, before any training.
    proc, log = _run(lambda port: [sys.executable, GPT, *GPT_TINY, "--backend", "megakernel"],
                     env=lambda port: _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port)))
    assert proc.returncode == 2, log
    assert "megakernel" in proc.stderr and "needs CUDA" in proc.stderr, log
    assert "Traceback" not in proc.stderr, log

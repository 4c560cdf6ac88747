"""A bad ``"uniep"`` block is caught before training, named in one line, and ends the job.

- ``uniep.<key>: expected <type>, got <type> <value>`` for a value of the wrong type read from JSON;
- the examples' ``--backend`` left out keeps the ds_config's backend, and the block is validated
  whichever MoE class runs (a typo such as ``"megakernal"`` is an error, not a silent default);
- a launched 2-rank example with a bad block exits non-zero at once with one error line.
"""
import importlib.util
import json
import os
import re
import sys
import time

import pytest

from dist_utils import run_launcher

from ds_uniep.config import UniEPConfig, UniEPConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(REPO, "examples", "gpt_moe", "train.py")
CIFAR = os.path.join(REPO, "examples", "cifar10_moe", "train.py")
BIN = os.path.dirname(sys.executable)


def _load(name, path):
    sys.path.insert(0, os.path.dirname(path))  # gpt_moe's train.py imports its data and model modules
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(os.path.dirname(path))


def _ds_config(tmp_path, block, name="ds_config.json"):
    with open(os.path.join(REPO, "configs", "ds_config_cpu_zero0.json")) as f:
        config = json.load(f)
    config["uniep"] = block
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("block,line", [
    ({"max_tokens_per_rank": "8192"}, "uniep.max_tokens_per_rank: expected int, got str '8192'"),
    ({"max_tokens_per_rank": 8192.0}, "uniep.max_tokens_per_rank: expected int, got float 8192.0"),
    ({"enabled": "yes"}, "uniep.enabled: expected bool, got str 'yes'"),
    ({"autotune": {"budget_s": "60"}}, "uniep.autotune.budget_s: expected number, got str '60'"),
    ({"autotune": {"cache_dir": 3}}, "uniep.autotune.cache_dir: expected str, got int 3"),
    ({"backend": "megakernal"},
     "uniep.backend: expected one of 'auto', 'reference', 'megakernel', got str 'megakernal'"),
    ({"hybrid": {"site_size": "4"}}, "uniep.hybrid.site_size: expected int or 'auto', got str '4'"),
    ({"hybrid": {"intra_site_bandwidth": None}},
     "uniep.hybrid.intra_site_bandwidth: expected number or 'measure', got null"),
    ({"overlap": 3}, "uniep.overlap: expected an object, got int 3"),
    # any other bad value: what is wrong, and the value (its own words, or "(got int 0)" after pydantic's)
    ({"max_tokens_per_rank": 0}, re.compile(r"uniep\.max_tokens_per_rank: .*\b(got int 0\)|got 0)$")),
])
def test_wrong_type_from_json_names_the_key_and_both_types(block, line, tmp_path):
    path = _ds_config(tmp_path, block)
    with pytest.raises(UniEPConfigError) as err:
        UniEPConfig.from_ds_config(path)  # read from the JSON file
    lines = str(err.value).splitlines()
    assert lines[0] == 'invalid "uniep" config:' and len(lines) == 2, str(err.value)
    if isinstance(line, str):
        assert lines[1] == f"  {line}", str(err.value)
    else:
        assert line.match(lines[1].strip()), str(err.value)


def test_every_bad_key_gets_one_line():
    with pytest.raises(UniEPConfigError) as err:
        UniEPConfig.from_dict({"backend": "gpu", "overlapp": {}, "max_tokens_per_rank": "1"})
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 3, lines
    by_key = {line.strip().split(":", 1)[0]: line.strip() for line in lines}
    assert by_key["uniep.backend"].startswith("uniep.backend: expected one of"), lines
    assert by_key["uniep.overlapp"].startswith("uniep.overlapp: unknown key"), lines
    assert by_key["uniep.max_tokens_per_rank"] == "uniep.max_tokens_per_rank: expected int, got str '1'", lines


def test_gpt_backend_flag_left_out_keeps_the_config_value(tmp_path):
    train = _load("gpt_moe_train_rel", GPT)
    path = _ds_config(tmp_path, {"backend": "megakernel", "max_tokens_per_rank": 64})
    args = train.get_args(["--deepspeed_config", path])
    assert args.backend is None
    assert train.uniep_config_for(args.backend, path).backend == "megakernel"
    cls, backend = train.moe_class_for(args.backend, path)
    assert backend == "megakernel" and cls.keywords["config"].max_tokens_per_rank == 64
    # A flag that is given is set over the block; the rest of the block stays.
    config = train.uniep_config_for("reference", path, "uniep")
    assert (config.backend, config.expert_gemm, config.max_tokens_per_rank) == ("reference", "uniep", 64)
    # No "uniep" block and no flag: the block's defaults.
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"train_batch_size": 2}))
    assert train.moe_class_for(None, str(plain))[1] == "auto"


@pytest.mark.parametrize("backend", [None, "reference", "deepspeed"])
def test_gpt_config_typo_is_an_error_whatever_the_flag(backend, tmp_path):
    train = _load("gpt_moe_train_rel", GPT)
    path = _ds_config(tmp_path, {"backend": "megakernal"} if backend is None else {"overlapp": {}})
    with pytest.raises(UniEPConfigError, match="megakernal" if backend is None else "uniep.overlapp: unknown key"):
        train.moe_class_for(backend, path)


def test_cifar_backend_flag_left_out_keeps_the_config_value(tmp_path):
    train = _load("cifar_train_rel", CIFAR)
    path = _ds_config(tmp_path, {"backend": "megakernel"})
    args = train.add_argument(["--deepspeed_config", path])
    assert args.backend is None
    assert train.moe_class_for(args, train.get_ds_config(args))[1] == "megakernel"
    args = train.add_argument(["--deepspeed_config", path, "--backend", "reference"])
    assert train.moe_class_for(args, train.get_ds_config(args))[1] == "reference"
    args = train.add_argument([])  # no config file: the flags build it, reference by default
    assert args.backend == "reference" and train.moe_class_for(args, train.get_ds_config(args))[1] == "reference"
    bad = _ds_config(tmp_path, {"backend": "megakernal"}, "bad.json")
    for argv in ([], ["--backend", "deepspeed"]):
        args = train.add_argument(["--deepspeed_config", bad] + argv)
        with pytest.raises(UniEPConfigError, match="uniep.backend: expected one of .* got str 'megakernal'"):
            train.moe_class_for(args, train.get_ds_config(args))


def test_one_line():
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        import launch_utils
    finally:
        sys.path.pop(0)
    assert launch_utils.one_line('invalid "uniep" config:\n  uniep.a: x\n  uniep.b: y') == \
        'invalid "uniep" config: uniep.a: x; uniep.b: y'
    assert launch_utils.one_line("plain") == "plain"


def _env():
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["PATH"] = os.pathsep.join(p for p in (env.get("PATH"), BIN) if p)
    return env


@pytest.mark.parametrize("example", ["gpt", "cifar"])
def test_launched_job_with_a_bad_block_ends_at_once_with_one_line(example, tmp_path):
    path = _ds_config(tmp_path, {"backend": "reference", "overlapp": {"schedule": "fused"}})
    script, extra = (GPT, []) if example == "gpt" else (CIFAR, ["--moe", "--ep-world-size", "2",
                                                               "--num-experts", "2"])
    start = time.monotonic()
    proc = run_launcher(lambda port: [
        os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
        str(port), script, "--deepspeed_config", path, *extra], env=lambda port: _env(), cwd=REPO, timeout=120)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    log = f"exit code {proc.returncode} after {took:.0f} s\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode != 0, log
    mentions = [line for line in out.splitlines() if "overlapp" in line]
    assert mentions == ['error: invalid "uniep" config: uniep.overlapp: unknown key; allowed keys here: '
                        + ", ".join(sorted(UniEPConfig.model_fields))], log
    assert not any(line.startswith("error:") for line in out.splitlines() if "overlapp" not in line), log
    assert 'File "' + script not in out, log  # no rank's traceback
    assert took < 90, log

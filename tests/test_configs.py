"""Every ds_config in configs/ validates in UniEPConfig and in DeepSpeed's own DeepSpeedConfig."""
import glob
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(glob.glob(os.path.join(REPO, "configs", "*.json")))
NAMES = [os.path.basename(p) for p in CONFIG_FILES]
EXPECTED = ["ds_config_uniep_default.json", "ds_config_uniep_fp8.json",
            "ds_config_uniep_autotune.json", "ds_config_uniep_fused.json",
            "ds_config_uniep_fused_interleaved.json", "ds_config_cpu_zero0.json",
            "ds_config_cpu_zero2.json", "ds_config_cpu_hybrid.json", "ds_config_uniep_zero0_bf16.json"]


def test_the_documented_configs_exist():
    missing = [n for n in EXPECTED if n not in NAMES]
    assert not missing, f"missing from configs/: {missing}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=NAMES)
def test_config_loads_in_uniep_and_deepspeed(path):
    from deepspeed.runtime.config import DeepSpeedConfig
    from ds_uniep import UniEPConfig
    with open(path) as f:
        raw = json.load(f)
    assert "uniep" in raw, "every shipped config carries a \"uniep\" block"
    # DeepSpeed 0.19.7+ refuses a top-level curriculum_learning (Megatron-DeepSpeed templates have one).
    assert "curriculum_learning" not in raw
    cfg = UniEPConfig.from_ds_config(path)
    assert UniEPConfig.from_ds_config(raw) == cfg
    ds = DeepSpeedConfig(path)
    assert ds.zero_optimization_stage == raw.get("zero_optimization", {}).get("stage", 0)
    assert ds.bfloat16_config.enabled == raw.get("bf16", {}).get("enabled", False)


def test_each_config_means_what_its_name_says():
    from ds_uniep import UniEPConfig
    cfg = {n: UniEPConfig.from_ds_config(p) for n, p in zip(NAMES, CONFIG_FILES)}
    assert cfg["ds_config_uniep_default.json"].knobs() == UniEPConfig().knobs()
    assert cfg["ds_config_uniep_fp8.json"].compression.dispatch_dtype == "fp8_e4m3"
    assert cfg["ds_config_uniep_autotune.json"].autotune.enabled
    fused = cfg["ds_config_uniep_fused.json"]
    assert fused.overlap.schedule == "fused" and fused.expert_gemm == "uniep"
    assert fused.overlap.epilogue_combine and not fused.overlap.fused_dispatch
    inter = cfg["ds_config_uniep_fused_interleaved.json"]
    assert inter.overlap.schedule == "fused" and inter.expert_gemm == "uniep"
    assert inter.overlap.fused_dispatch and inter.overlap.epilogue_combine and inter.overlap.roles == "interleaved"
    for n in ("ds_config_cpu_zero0.json", "ds_config_cpu_zero2.json", "ds_config_cpu_hybrid.json"):
        assert cfg[n].backend == "reference", n
    hybrid = cfg["ds_config_cpu_hybrid.json"].hybrid
    assert hybrid.enabled and hybrid.domain_size == 2 and hybrid.reuse_replicas
    for n in NAMES:
        with open(os.path.join(REPO, "configs", n)) as f:
            raw = json.load(f)
        if n.startswith("ds_config_cpu_"):
            assert not raw.get("bf16", {}).get("enabled", False), f"{n}: CPU configs are fp32"
        else:
            assert raw.get("bf16", {}).get("enabled", False), f"{n}: GPU configs are bf16"
    stages = {n: json.load(open(os.path.join(REPO, "configs", n)))["zero_optimization"]["stage"] for n in NAMES}
    assert stages["ds_config_cpu_zero0.json"] == 0 and stages["ds_config_cpu_zero2.json"] == 2
    assert stages["ds_config_uniep_zero0_bf16.json"] == 0

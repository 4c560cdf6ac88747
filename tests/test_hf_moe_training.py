"""The Hugging Face MoE example (examples/hf_moe/train.py) trains under DeepSpeed on ds_uniep.

Two CPU ranks (gloo), expert-parallel size 2, reference backend: Qwen3-MoE, Mixtral and DeepSeek-V3
(shared experts, group-limited routing, the expert bias updated every step), each under ZeRO-1 and
ZeRO-2, 50 steps. For each, in the same two processes, the example's ``main`` runs three times:
straight through, then the first half saved with ``--save``, then resumed with ``--load``: the loss
goes down, and the runs' losses are bitwise equal step by step (the expert bias travels in the
checkpoint). The resumed run writes the model in its Hugging Face layout (``--save-hf``); plain
transformers loads it and gives the trained model's logits on a probe batch (fp32 rounding: the
experts' sums run in another order there).
"""
import importlib.util
import json
import os

import pytest

pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "hf_moe", "train.py")
STEPS, HALF = 50, 25
RUNS = tuple((model_type, zero) for model_type in ("qwen3_moe", "mixtral", "deepseek_v3") for zero in (1, 2))


def _losses(path):
    with open(path) as f:
        return {int(k): float.fromhex(v) for k, v in json.load(f).items()}


def _probe():
    import torch
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(99))


def _train_runs(rank, world, tmp):
    import torch
    spec = importlib.util.spec_from_file_location("hf_moe_train", TRAIN)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    for model_type, zero in RUNS:
        base = ["--model-type", model_type, "--zero-stage", str(zero), "--hidden-size", "32",
                "--expert-ffn-size", "32", "--seq-length", "32", "--corpus-max-bytes", "200000",
                "--train-iters", str(STEPS), "--seed", "7"]
        out = os.path.join(tmp, f"{model_type}-zero{zero}")
        train.main(base + ["--loss-log", f"{out}-full.json"])
        train.main(base + ["--loss-log", f"{out}-first.json", "--save", f"{out}-ckpt", "--exit-interval", str(HALF)])
        model = train.main(base + ["--loss-log", f"{out}-resumed.json", "--load", f"{out}-ckpt",
                                   "--save-hf", f"{out}-hf"])
        model.eval()
        with torch.no_grad():
            logits = model(_probe()).logits
        if rank == 0:
            torch.save(logits, f"{out}-logits.pt")


def test_example_trains_resumes_bitwise_and_saves_hf(tmp_path):
    run_distributed(_train_runs, 2, str(tmp_path), timeout=600)
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    import sys
    sys.path.insert(0, os.path.join(REPO, "examples", "gpt_moe"))
    from data import TextSplits, load_corpus
    splits = TextSplits(load_corpus(200000)[0], 32)
    x, y = splits.train_batch(7, STEPS, 0, 1, 8)
    for model_type, zero in RUNS:
        out = os.path.join(tmp_path, f"{model_type}-zero{zero}")
        full, first, resumed = (_losses(f"{out}-{n}.json") for n in ("full", "first", "resumed"))
        assert sorted(full) == list(range(1, STEPS + 1)), model_type
        assert sorted(first) == list(range(1, HALF + 1)) and sorted(resumed) == list(range(HALF + 1, STEPS + 1))
        assert full[STEPS] < full[1] - 1.0, (model_type, full[1], full[STEPS])
        for step, loss in {**first, **resumed}.items():
            assert loss == full[step], (model_type, step, loss.hex(), full[step].hex())
        model = AutoModelForCausalLM.from_pretrained(f"{out}-hf").eval()
        assert model.config.model_type == model_type
        with torch.no_grad():
            loss = F.cross_entropy(model(x).logits.reshape(-1, 256), y.reshape(-1)).item()
        assert loss < full[1] - 1.0, (model_type, loss, full[1])
        with torch.no_grad():
            got = model(_probe()).logits
        want = torch.load(f"{out}-logits.pt")
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (model_type, zero, (got - want).abs().max())

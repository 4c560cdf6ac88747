"""convert_hf_model at expert-parallel size 4 (two experts per rank): DeepSeek-V3 in fp32, with the
checks of tests/test_hf_convert.py (logits, every layer's choices, every gradient, the expert bias)."""
import pytest

pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402
from test_hf_convert import _parity  # noqa: E402


def test_deepseek_v3_at_ep4():
    run_distributed(_parity, 4, ("deepseek_v3", ), ("float32", ), None, timeout=300)

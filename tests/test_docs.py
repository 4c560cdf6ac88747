"""The docs say what the code does: docs/config.md is the code's, CHANGELOG is Keep a Changelog."""
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_config_doc_is_the_code_s():
    spec = importlib.util.spec_from_file_location("gen_config", os.path.join(ROOT, "docs", "gen_config.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert _read("docs/config.md") == gen.render(), \
        "regenerate it: python docs/gen_config.py"


def test_readme_links_exist():
    readme = _read("README.md")
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert os.path.exists(os.path.join(ROOT, target)), target


def test_readme_has_the_two_commands_ci_runs():
    readme = _read("README.md")
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        block = readme.split(marker, 1)[1].split("```", 2)[1]
        assert block.startswith("bash\n") and len(block.strip().splitlines()) == 2, block
    assert "pytest" in readme.split("<!-- test-command -->", 1)[1].split("```", 2)[1]


def test_changelog_is_keep_a_changelog():
    text = _read("CHANGELOG.md")
    assert "keepachangelog.com" in text and "## [Unreleased]" in text
    for heading in re.findall(r"^### (.+)$", text, flags=re.M):
        assert heading in {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, heading


def test_benchmark_shapes_doc_is_the_presets():
    from ds_uniep.hybrid.presets import PRESETS
    from ds_uniep.tuning.presets import num_experts_at
    text = _read("docs/performance.md")
    rows = {m.group(1): tuple(int(v) for v in m.groups()[1:])
            for m in re.finditer(r"^\| ([\w-]+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", text, flags=re.M)}
    assert rows == {name: (s.hidden, s.ffn, s.num_experts, s.top_k, s.tokens_per_rank) for name, s in PRESETS.items()}
    assert "At ep 4 the dsv3-like layer runs 32 experts" in text and num_experts_at("dsv3-like", 4) == 32


def test_performance_doc_cites_exactly_the_result_files_kept():
    text = _read("docs/performance.md")
    results = os.path.join(ROOT, "docs", "results")
    for name in os.listdir(results):
        shaped = re.sub(r"(mixtral|dsv2lite|dsv3)-like", "<shape>", name)
        assert name in text or shaped in text, f"docs/results/{name} is cited by no table of docs/performance.md"
    for cited in re.findall(r"docs/results/([\w.<>-]+)", text):
        for shape in ("mixtral-like", "dsv2lite-like", "dsv3-like"):
            assert os.path.exists(os.path.join(results, cited.replace("<shape>", shape))), cited

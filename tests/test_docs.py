"""The docs say what the code does: README's config list is the code's, CHANGELOG is Keep a Changelog."""
import os
import re

from ds_uniep.config import describe_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_readme_lists_every_config_field_as_the_code_describes_it():
    readme = _read("README.md")
    section = readme.split("<!-- config-fields -->\n", 1)[1].split("<!-- /config-fields -->", 1)[0]
    expected = "".join(f"- `{k}`: {v}\n" for k, v in describe_fields().items())
    assert section == expected, "regenerate the README section with `python -m ds_uniep.config`:\n" + expected


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
    text = _read("docs/benchmarks.md")
    rows = {m.group(1): tuple(int(v) for v in m.groups()[1:])
            for m in re.finditer(r"^\| ([\w-]+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", text, flags=re.M)}
    assert rows == {name: (s.hidden, s.ffn, s.num_experts, s.top_k, s.tokens_per_rank) for name, s in PRESETS.items()}
    assert "At ep 4 the dsv3-like layer runs 32 experts" in text and num_experts_at("dsv3-like", 4) == 32

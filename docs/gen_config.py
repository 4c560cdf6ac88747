"""Render docs/config.md from the ``"uniep"`` config classes (their types, defaults and descriptions).

    python docs/gen_config.py          # writes docs/config.md

``tests/test_docs.py`` checks that docs/config.md is this script's output.
"""
import json
import os
import sys
import typing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed.runtime.config_utils import DeepSpeedConfigModel  # noqa: E402

from ds_uniep.config import UNIEP_KEY, UniEPConfig  # noqa: E402

HEADER = """\
# The `"uniep"` block

ds_uniep reads its settings from a `"uniep"` block at the top level of `ds_config.json` (or from
`UniEPMoE(..., config=...)`). Every key is optional. Unknown keys and badly typed values raise
`UniEPConfigError` naming the key and the allowed values, when the layer is built.

```json
"uniep": {
  "backend": "auto",
  "max_tokens_per_rank": 8192,
  "overlap": {"schedule": "sequential"},
  "compression": {"dispatch_dtype": "activation"},
  "autotune": {"enabled": false}
}
```

This page is generated from the code (`ds_uniep/config.py`) by `python docs/gen_config.py`.
"""


def _is_block(ann) -> bool:
    return isinstance(ann, type) and issubclass(ann, DeepSpeedConfigModel)


def _type(field) -> str:
    """``int, >= 1, <= 64``; ``"a" | "b"``; ``int | "auto"``; ``int | null``."""

    def one(ann):
        if typing.get_origin(ann) is typing.Literal:
            return [json.dumps(v) for v in typing.get_args(ann)]
        if typing.get_origin(ann) is typing.Union:
            return [p for a in typing.get_args(ann) for p in one(a)]
        if ann is type(None):
            return ["null"]
        return [getattr(ann, "__name__", str(ann))]

    text = " | ".join(one(field.annotation))
    ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    bounds = [f"{ops[k]} {getattr(m, k)}" for m in field.metadata for k in ops if hasattr(m, k)]
    if bounds:
        text += ", " + ", ".join(bounds)
    return text


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _sections(model_cls, prefix, intro=""):
    rows, nested = [], []
    for name, field in model_cls.model_fields.items():
        if _is_block(field.annotation):
            nested.append((field.annotation, f"{prefix}.{name}", field.description or ""))
            continue
        default = field.default if field.default_factory is None else field.default_factory()
        rows.append(f"| `{name}` | `{_cell(_type(field))}` | `{json.dumps(default)}` | "
                    f"{_cell(field.description or '')} |")
    out = [f"## `{prefix}`\n"]
    if intro:
        out.append(_cell(intro) + "\n")
    out.append("| key | type | default | description |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    text = "\n".join(out)
    for cls, key, desc in nested:
        text += "\n" + _sections(cls, key, desc)
    return text


def render() -> str:
    """The whole of docs/config.md."""
    return HEADER + "\n" + _sections(UniEPConfig, UNIEP_KEY)


if __name__ == "__main__":
    # Written here rather than to stdout: importing deepspeed may print to stdout.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.md")
    with open(path, "w") as f:
        f.write(render())
    print(f"wrote {path}")

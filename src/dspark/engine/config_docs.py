"""docs/engine.md's options table, generated from :class:`dspark.engine.config.EngineConfig`'s fields
and the docstrings under them (see [Note: options declared once] there)."""

from __future__ import annotations

import ast
import functools
import itertools
from dataclasses import fields
from pathlib import Path

from dspark.engine import config
from dspark.engine.config import GROUP_OF, GROUPS, EngineConfig

__all__ = ["option_docs", "options_table"]


@functools.cache
def option_docs() -> dict[str, tuple[str | None, str, str]]:
    """Every option as the docs show it: ``name -> (group or None, default as code, one-line doc)``,
    the doc read from the docstring under its field.

    Example::

        option_docs()["bucket_mb"]   # ("communication", "25.0", "Gradient bucket size in MiB: ...")
    """
    tree = ast.parse(Path(config.__file__).read_text(encoding="utf-8"))
    docs: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for here, after in itertools.pairwise(node.body):
                if (isinstance(here, ast.AnnAssign) and isinstance(here.target, ast.Name)
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
                    text = " ".join(str(after.value.value).split())
                    docs[f"{node.name}.{here.target.id}"] = text.replace("``", "`")
    out: dict[str, tuple[str | None, str, str]] = {}
    for name, group in GROUP_OF.items():
        if name in GROUPS:
            continue
        owner = EngineConfig if group is None else GROUPS[group]
        (f,) = [f for f in fields(owner) if f.name == name]
        out[name] = (group, repr(f.default), docs.get(f"{owner.__name__}.{name}", ""))
    return out


def options_table() -> str:
    """docs/engine.md's options table, generated from the fields (see [Note: options declared once]).

    Example::

        print(options_table())   # | option | group | default | meaning | ...
    """
    lines = ["| option | group | default | meaning |", "|---|---|---|---|"]
    for name, (group, default, doc) in option_docs().items():
        lines.append(f"| `{name}` | {group or ''} | `{default}` | {doc} |")
    return "\n".join(lines)

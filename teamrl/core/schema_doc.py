"""The config reference (docs/config.md): one row per key of the schema, registered sections included."""

from __future__ import annotations

import dataclasses
import typing

from teamrl.core.config import SECTIONS, Config, load_section_providers


def describe_schema(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) rows for the config reference (docs/config.md) (the registered sections after the
    built-in keys)."""
    rows = _describe_fields(cls, prefix)
    if cls is Config and not prefix:
        load_section_providers()
        for name, section in SECTIONS.items():
            rows += describe_schema(section, name + ".")
    return rows


def _describe_fields(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        sub = tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else (inner[0] if inner else None)
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
        )
        if sub is not None:
            if f.metadata.get("doc"):
                rows.append((prefix + f.name, "mapping or null" if inner else "mapping", "", f.metadata["doc"]))
            rows += describe_schema(sub, prefix + f.name + ".")
            continue
        doc = f.metadata.get("doc", "")
        if f.metadata.get("choices"):
            doc += f" (one of {', '.join(f.metadata['choices'])})"
        rows.append(
            (
                prefix + f.name,
                str(tp).replace("typing.", "").replace("<class '", "").replace("'>", ""),
                repr(default),
                doc,
            )
        )
    return rows


def schema_table() -> str:
    """The config reference as a Markdown table, one row per key of :func:`describe_schema`."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in describe_schema():
        lines.append(f"| `{key}` | {tp} | `{default}` | {doc} |" if default else f"| `{key}` | {tp} | | {doc} |")
    return "\n".join(lines) + "\n"

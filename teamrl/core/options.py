"""Declared options: :func:`option` (a dataclass field with its type, choices, range, memory cost and doc), and the
checks that build a dataclass of them from plain data (:func:`build_dataclass`) or check one built in Python
(:func:`check_fields`), each failing in one line that names the key and what is accepted.

The config schema (:mod:`teamrl.core.config`) and every task's, workflow's and algorithm's options are declared with
them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

from teamrl.core.errors import ConfigError

# The least memory one unit of a size costs: lower bounds, so that a size refused for them cannot fit whatever the model
# a sampled token: its id in the engine (8) and in the sample (a list slot, 8), its log-prob (a float, 32)
BYTES_PER_TOKEN = 48
BYTES_PER_SAMPLE = 512  # a sample's object and its prompt, before any token of its completion
BYTES_PER_PROBLEM = 256  # a task's problem: its object, id and text
# sizes that the options of tasks and workflows declare without ``bytes_each``, by field name
SIZE_BYTES = {"num_problems": BYTES_PER_PROBLEM}
MAX_NAME_BYTES = 255  # a run name is a folder name (NAME_MAX)


def machine_memory() -> int:
    """Bytes of memory this process can have: the machine's physical memory, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_memory(what: str, need: int, how: str, at_most: str = "") -> None:
    """Refuse, before anything is allocated, an input whose least memory ``need`` (bytes, ``how`` it was counted) is
    over what this machine has: a :class:`ConfigError` naming ``what`` (and ``at_most``: the largest value that
    fits)."""
    have = machine_memory()
    if need > have:
        raise ConfigError(f"{what} needs at least {_gib(need)} of memory ({how}), more than the {_gib(have)} of memory "
                          f"this machine has" + (f"; at most {at_most}" if at_most else ""))


def option(default: Any = dataclasses.MISSING, *, choices: tuple | None = None, ge: float | None = None,
       gt: float | None = None, le: float | None = None, doc: str = "", factory: Any = None,
       hints: dict[str, str] | None = None, bytes_each: int | None = None, internal: bool = False) -> Any:
    """A config field with its allowed values or range and a one-line doc for the reference.

    ``hints`` maps a value that is not allowed but likely meant (another tool's name) to a short
    note appended to its error. ``bytes_each``: the field is a size, each unit of which costs at least
    this many bytes of memory; a value whose cost is over the machine's memory is refused before
    anything is allocated (:func:`check_memory`). ``internal``: not a config key (a value derived from others, set
    in Python), still checked by :func:`check_fields`."""
    meta = {
        "choices": choices,
        "ge": ge,
        "gt": gt,
        "le": le,
        "doc": doc,
        "hints": hints or {},
        "bytes_each": bytes_each,
    }
    if internal:
        meta["internal"] = True
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)



def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; build nested dataclasses."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{key}: got {value!r}, expected one of {[_type_name(a) for a in args]}"
        )
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {[f.name for f in dataclasses.fields(tp)]}, got {value!r}")
        return build_dataclass(tp, value, key + ".")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {_type_name(inner)}, got {value!r}")
        return [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # a free-form mapping: its keys and values are checked against the annotation too
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            raise ConfigError(
                f"{key}: expected a mapping of {_type_name(key_tp)} to {_type_name(value_tp)}, got {value!r}"
            )
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise ConfigError(
                    f"{key}: key {k!r} is not a string; expected a mapping of str to {_type_name(value_tp)} "
                    "(quote the key)"
                )
            out[k] = coerce(v, value_tp, f"{key}.{k}")
        return out
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # .inf / .nan would reach the weights (lr, eps, coefficients)
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported type {tp}")  # a schema bug, not a user error


def _check_range(f: dataclasses.Field, value: Any, key: str) -> None:
    m = f.metadata
    if value is None:
        return
    if m.get("choices") and value not in m["choices"]:
        hint = m.get("hints", {}).get(value) if isinstance(value, str) else None
        raise ConfigError(
            f"{key}: {value!r} is not allowed; choose one of {list(m['choices'])}" + (f" ({hint})" if hint else "")
        )
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        b = m.get(bound)
        if b is not None and not ok(value, b):
            raise ConfigError(f"{key}: {value!r} is out of range; must be {word} {b}")
    each = m.get("bytes_each") or SIZE_BYTES.get(f.name)
    if each and isinstance(value, int) and not isinstance(value, bool):
        check_memory(f"{key}={value}", value * each, f"{each} bytes each", str(machine_memory() // each))


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Validate ``data`` against the dataclass ``cls`` (same rules as the config) and build it."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown key; allowed keys are {sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        key = prefix + name
        v = coerce(value, hints[name], key)
        _check_range(fields[name], v, key)
        kwargs[name] = v
    return cls(**kwargs)


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check a dataclass instance built in Python by the config's own rules (each field's type, choices and range,
    :func:`option`), with the config's one-line messages, ``prefix`` naming it (``LossConfig.``): the one mechanism
    for a section that is also built directly (call it from ``__post_init__``). Numbers are stored as the field's
    type (an int given for a float field becomes a float)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        key = prefix + f.name
        value = coerce(getattr(obj, f.name), hints[f.name], key)
        _check_range(f, value, key)
        object.__setattr__(obj, f.name, value)



"""Reading YAML for the config (a config file, ``key.sub=value`` overrides, a study file): bounded and strict.

No key twice in a mapping, no alias bomb, no anchor containing itself, no file over :data:`MAX_CONFIG_BYTES`;
every error is one line (:class:`~teamrl.core.errors.ConfigError`) naming the input and where.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from teamrl.core.errors import ConfigError

MAX_CONFIG_BYTES = 8 << 20  # a config file (or study file) larger than this is refused before it is read
MAX_YAML_REPEATS = 100_000  # the most nodes that aliases (*name) may repeat in one YAML document


class _DuplicateKey(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last one
    silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` entries may be overridden on purpose
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_line:
                    raise _DuplicateKey(None, None, f"duplicate key {key!r} (first given on line {first_line[key]}); "
                                        "give each key once", key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base loader reports it
                pass
        return super().construct_mapping(node, deep=deep)

    def construct_document(self, node: yaml.Node) -> Any:
        _check_repeats(node)
        return super().construct_document(node)


class _YamlBomb(yaml.YAMLError):
    """A YAML document whose aliases repeat too many nodes (a 'billion laughs'), or one that contains itself."""


def _check_repeats(root: yaml.Node) -> None:
    """Refuse, before anything is built, a document whose aliases (``*name``) repeat more than :data:`MAX_YAML_REPEATS`
    nodes, or an anchor that contains an alias of itself. The composed document is a graph whose nodes aliases
    share; its size expanded is counted once per node (linear time, no recursion)."""
    expanded: dict[int, int] = {}  # id(node) -> its size with every alias expanded
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in expanded:
            continue
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            expanded[id(node)] = 1
            continue
        if children_done:
            on_path.discard(id(node))
            expanded[id(node)] = 1 + sum(expanded[id(c)] for c in children)
            continue
        if id(node) in on_path:
            continue
        on_path.add(id(node))
        stack.append((node, True))
        for c in children:
            if id(c) in on_path:
                mark = c.start_mark
                raise _YamlBomb(f"line {mark.line + 1}, column {mark.column + 1}: an anchor (&name) refers to itself "
                                "through an alias (*name); a config cannot contain itself")
            if id(c) not in expanded:
                stack.append((c, False))
    distinct = len(expanded)
    if expanded[id(root)] - distinct > MAX_YAML_REPEATS:
        raise _YamlBomb(f"its aliases (*name) repeat {expanded[id(root)] - distinct} nodes; at most {MAX_YAML_REPEATS} "
                        "repeated nodes are accepted (write the values out, or use fewer aliases)")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line saying what is wrong with YAML text, and where."""
    if isinstance(e, _YamlBomb):
        return str(e)
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        if isinstance(e, _DuplicateKey):
            return f"{where}: {e.problem}"
        return f"not valid YAML ({where}): {e.problem or e.context}"
    return f"not valid YAML: {' '.join(str(e).split())}"


def load_yaml(text: str, what: str) -> Any:
    """YAML text (a config file's, an override's value) with the config's rules: no key twice in a mapping, no alias
    bomb, no anchor containing itself, no nesting deeper than Python's stack; an error is one line naming ``what``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}: {_yaml_problem(e)}") from None
    except RecursionError:
        raise ConfigError(
            f"{what}: nested too deeply to read; a config is a few levels of mappings and lists"
        ) from None


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The mapping at the top of a YAML file; errors (missing, empty, not YAML, a duplicate key,
    not a mapping) are one line that names ``what`` and the path."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(f"{what} {str(p)!r} is {size / 2**20:.1f} MiB; at most {MAX_CONFIG_BYTES >> 20} MiB "
                                  "is read (a config is a few KiB; large data belongs in a data file the task reads)")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{what} {str(p)!r} cannot be read ([Errno {e.errno}] {e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:  # grew while being read
        raise ConfigError(
            f"{what} {str(p)!r} is over {MAX_CONFIG_BYTES >> 20} MiB; at most {MAX_CONFIG_BYTES >> 20} MiB is read"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, column "
                          f"{column}); save it as UTF-8") from None
    loaded = load_yaml(text, f"{what} {str(p)!r}")
    if loaded is None:
        raise ConfigError(f"{what} {str(p)!r} is empty; give at least one key (e.g. task), "
                          "or leave the file out to use the defaults")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {str(p)!r}: expected a mapping at the top level")
    return loaded


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {p} is not a mapping, cannot set a sub-key")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``["train.lr=1e-4", "policy.lora=null"]`` -> [(key, parsed YAML value), ...]."""
    out = []
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r}: expected key.sub=value")
        k, v = o.split("=", 1)
        k = k.strip()
        out.append((k, load_yaml(v, f"override {k}") if v.strip() else ""))
    return out

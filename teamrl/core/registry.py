"""Named registries that users extend: a decorator, a ``package.module:object`` reference, or a plugin.

A :class:`Registry` maps names to objects of one kind (tasks, workflows, rewards); each layer
keeps its own instance and registers what it ships. Users add to them three ways:

- ``@registry.register("name")`` in their own code (a file loaded with ``teamrl ... --plugin
  FILE``, see :func:`load_plugin`, or any module they import);
- a config value ``package.module:object`` (imported on lookup, no registration needed);
- an installed package that declares an entry point in the group ``teamrl.plugins``: every such
  entry point is loaded (imported) the first time a lookup misses.

A name that is not registered is a :class:`~teamrl.core.config.ConfigError` that names what is.
This module names no task, workflow or algorithm.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import MutableMapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, TypeVar

from teamrl.core.config import ConfigError, InputError, InputFileMissing

T = TypeVar("T")
ENTRY_POINT_GROUP = "teamrl.plugins"
_entry_points_loaded = False


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Import every entry point of ``group`` (installed plugins register on import); their names."""
    global _entry_points_loaded
    _entry_points_loaded = True
    names = []
    for ep in entry_points(group=group):
        ep.load()
        names.append(ep.name)
    return names


class PluginError(InputError):
    """A ``--plugin`` file does not compile or raised while it was imported; one line naming the file and line."""


def load_plugin(path: str | Path) -> str:
    """Import the Python file at ``path`` as a module (its decorators register what it defines);
    returns the module name. A missing file is an :class:`InputFileMissing`; a syntax error, or an
    exception its import raised (other than a :class:`ConfigError` of its own, which passes as it is),
    is a :class:`PluginError` naming the file and line (``TEAMRL_TRACEBACK=1`` shows the traceback)."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".py":
        raise InputFileMissing(f"--plugin {str(p)!r}: no such Python file; give the path of a .py file that registers "
                               "tasks, workflows or rewards")
    name = f"teamrl_plugin_{p.stem}"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == p.resolve():
        return name  # imported already in this process (a second run of the CLI): its registrations stand
    spec = importlib.util.spec_from_file_location(name, p)
    assert spec is not None and spec.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(name, None)  # a half-imported plugin is not left behind
        if isinstance(e, ConfigError) or not isinstance(e, (Exception, SystemExit)):  # Ctrl-C stays Ctrl-C
            raise
        raise PluginError(_plugin_failure(p, e)) from e
    return name


def _plugin_failure(path: Path, e: BaseException) -> str:
    """One line: where the plugin file failed and why."""
    if isinstance(e, SyntaxError):  # IndentationError and TabError too
        where = f"{e.filename or path}:{e.lineno}" + (f":{e.offset}" if e.offset else "")
        return f"--plugin {where}: {e.msg} ({type(e).__name__}); fix the file"
    import traceback

    own = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    where = f"{path}:{own[-1].lineno}" if own else str(path)
    message = " ".join(str(e).split())
    return (f"--plugin {path}: importing it raised {type(e).__name__}{': ' + message if message else ''} at {where}; "
            "fix the file (TEAMRL_TRACEBACK=1 shows the traceback)")


def import_reference(reference: str, key: str) -> Any:
    """The object named by ``package.module:object`` (``object`` may be dotted)."""
    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}: {reference!r} is not a reference; write package.module:object")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{key}: {reference!r}: cannot import module {module_name!r} ({e})") from None
    except SyntaxError as e:
        raise ConfigError(f"{key}: {reference!r}: module {module_name!r} does not compile: {e.filename}:{e.lineno}: "
                          f"{e.msg}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: {reference!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


class Registry(MutableMapping[str, T], Generic[T]):
    """Objects of one ``kind`` by name, extended by users (see the module docstring).

    ``convert`` turns what a ``package.module:object`` reference names into an entry (e.g. the
    workflow a decorated function carries); by default the object itself is the entry.
    """

    def __init__(self, kind: str, convert: Callable[[Any], T] | None = None) -> None:
        self.kind = kind
        self._convert = convert
        self._items: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None) -> Any:
        """Register ``obj`` as ``name``; without ``obj``, a decorator that registers what it decorates.
        A name already taken by another object is an error (one line naming both)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(f"register {self.kind}: name {name!r} must be a non-empty string without ':'")

        def add(value: T) -> T:
            old = self._items.get(name)
            if old is not None and old is not value:
                raise ConfigError(f"{self.kind} {name!r} is already registered ({_describe(old)}); choose another name")
            self._items[name] = value
            return value

        return add if obj is None else add(obj)

    def get_entry(self, name: str, key: str) -> T:
        """The entry for a config value at ``key``: a registered name or ``package.module:object``."""
        if not isinstance(name, str):
            raise ConfigError(
                f"{key}: expected a string (a registered {self.kind} or package.module:object), got {name!r}"
            )
        if isinstance(name, str) and ":" in name:
            obj = import_reference(name, key)
            return self._convert(obj) if self._convert is not None else obj
        if name not in self._items and not _entry_points_loaded:
            load_entry_points()
        if name not in self._items:
            raise ConfigError(f"{key}: {name!r} is not a registered {self.kind}; registered: {sorted(self._items)} "
                              "(register your own with a decorator and --plugin FILE, or write package.module:object)")
        return self._items[name]

    # MutableMapping: tests may add and remove entries (monkeypatch.setitem) as on a dict
    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __setitem__(self, name: str, value: T) -> None:
        self._items[name] = value

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._items)})"


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"

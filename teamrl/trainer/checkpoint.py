"""Checkpoints: each policy's own weights and optimizer, RNG states, step and data position.

A checkpoint is written to a temporary folder and renamed into place, so a run killed
mid-save never leaves a half-written checkpoint that ``--resume`` would pick up. A weight or
optimizer state holding a NaN/inf is refused before anything is written: no checkpoint holds one.
A write that fails (a full disk, a read-only run directory) removes the temporary folder and is a
:class:`CheckpointWriteError` (one line; the checkpoints before it are untouched). A file that does
not read back whole (truncated, corrupt) is a :class:`CheckpointUnreadable` naming it;
:func:`checkpoint_to_resume` checks the newest checkpoint before a resume and finds the newest
intact one. A run's warm start (``teamrl sft``) is kept apart from the rotated checkpoints, in
``RUN_DIR/warm_start/`` with ``RUN_DIR/warm_start.json`` (:func:`record_warm_start`);
:func:`resolve_checkpoint` reads a run directory or a checkpoint folder given on the command line.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import pickletools
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from teamrl.core.config import InputError, InputFileMissing
from teamrl.core.seeding import rng_state, set_rng_state
from teamrl.policies.router import PolicyRouter

_STEP_DIR = re.compile(r"^step_(\d+)$")
# what a run directory that cannot take a write fails with (full, over quota, read-only, not ours)
UNWRITABLE = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)


class RunDirError(InputError):
    """The run directory cannot be created or written (read-only, not writable, a file, full); the message is one
    line."""


class CheckpointWriteError(RunDirError):
    """Writing a checkpoint failed (e.g. no space left); its temporary folder is removed, older checkpoints are
    intact."""


class CheckpointUnreadable(InputError):
    """A checkpoint file does not read back whole (truncated or corrupt); the message names the file."""


class CheckpointMismatch(InputError):
    """A checkpoint file reads whole but does not hold what this run needs (another model or LoRA rank, a tensor of
    another shape, a trainer state without its keys); the message names the file, the entry and what was expected."""


class PolicyStates(Protocol):
    """What a checkpoint reads and restores of the policies, wherever they live (a
    :class:`~teamrl.trainer.learner.Learner`)."""

    def policy_names(self) -> list[str]: ...

    def state(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    def load_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None: ...


class RouterStates:
    """:class:`PolicyStates` of the policies of one in-process router."""

    def __init__(self, router: PolicyRouter) -> None:
        self.router = router

    def policy_names(self) -> list[str]:
        return list(self.router.policies)

    def state(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        pol = self.router.policies[name]
        return pol.named_state(), pol.optimizer.state_dict()

    def load_state(self, name: str, weights: dict[str, torch.Tensor], optimizer: dict[str, Any]) -> None:
        pol = self.router.policies[name]
        pol.load_named_state(weights)
        pol.load_optimizer_state(optimizer)


def _states(policies: PolicyRouter | PolicyStates) -> PolicyStates:
    return RouterStates(policies) if isinstance(policies, PolicyRouter) else policies


def _first_nonfinite(tree: Any, path: str = "") -> str | None:
    """The path of the first tensor in a nested dict/list that holds a NaN or inf, else None."""
    if isinstance(tree, torch.Tensor):
        return path if tree.is_floating_point() and not bool(torch.isfinite(tree).all()) else None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        found = _first_nonfinite(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def save_checkpoint(
    folder: Path, step: int, policies: PolicyRouter | PolicyStates, state: dict[str, Any], keep: int = 2
) -> Path:
    """Write ``folder/step_N`` (each policy of a router or a learner) and keep only the ``keep`` newest checkpoints.

    Raises ValueError, writing nothing, when a policy's weights or optimizer state hold a NaN/inf.
    """
    states = _states(policies)
    saved = {name: states.state(name) for name in states.policy_names()}
    for name, (weights, optim) in saved.items():
        for what, tree in (("weight", weights), ("optimizer state", optim)):
            bad = _first_nonfinite(tree)
            if bad is not None:
                raise ValueError(
                    f"checkpoint step {step}: policy {name!r} {what} {bad} holds a NaN/inf; refusing to save it"
                )
    final = folder / f"step_{step:06d}"
    tmp = folder / f".tmp_step_{step:06d}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, (weights, optim) in saved.items():
            _write(weights, tmp / f"policy_{name}.pt")
            _write(optim, tmp / f"optimizer_{name}.pt")
        _write({**state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # give back the space the half-written checkpoint took
        before = [p.name for p in list_checkpoints(folder)]
        kept = (
            f"the checkpoints before it are intact ({', '.join(before)})" if before else "no earlier checkpoint exists"
        )
        reason = f"[Errno {e.errno}] {e.strerror}" if e.strerror else str(e)
        raise CheckpointWriteError(f"checkpoint {final} could not be written ({reason}); {kept}: free space or make "
                                   f"{folder} writable, then continue with teamrl train ... --resume") from e
    except BaseException:  # Ctrl-C or SIGTERM mid-write: no half-written folder stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file: a failed write is an ``OSError`` with its errno (ENOSPC, EROFS),
    where torch's own writer raises a RuntimeError such as ``unexpected pos 6784 vs 6676``."""
    with open(path, "wb") as f:
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            # Ctrl-C or SIGTERM inside torch.save: its zip writer then fails closing the file ("unexpected pos"), and
            # that error would hide the interrupt (exit 1 and a traceback instead of the one-line stop)
            cause: BaseException | None = e.__context__
            while cause is not None and isinstance(cause, Exception):
                cause = cause.__context__
            if cause is not None:
                raise cause from None
            # torch's zip writer can see a short write on a full disk first (``unexpected pos 125824 vs 125712``),
            # before any OSError: a file system with less than a block left is that disk-full error
            free = os.statvfs(path.parent)
            if free.f_bavail * free.f_frsize < 2 * free.f_bsize:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
            raise


# What checkpoints written before RNG states were plain data hold besides tensors: numpy's RNG key array.
# Rebuilding an array runs no code of the file's choosing; anything else that is not plain data is refused.
_LEGACY_SAFE_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


# What a checkpoint file's pickle may unfold to, checked on its opcodes before torch unpickles it: teamrl's own
# files hold thousands of values, a handful of levels deep. Unpickling itself hashes dict keys (a tuple key of
# shared references unfolds while it is hashed) and torch walks lists on load, so a bomb must be refused unread.
MAX_CHECKPOINT_VALUES = 1_000_000
MAX_CHECKPOINT_DEPTH = 32
MAX_CHECKPOINT_PICKLE_BYTES = 64 << 20
_MUTATORS = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})  # change the object below


class _Node:
    """A value the pickle builds, as the scan sees it: how many values it unfolds to, how deep it nests, what it
    holds (labelled by key or position, for the message) and whether it is already inside another value."""

    __slots__ = ("size", "depth", "children", "label", "sealed")

    def __init__(self, label: Any = None) -> None:
        self.size, self.depth, self.label, self.sealed = 1, 0, label, False
        self.children: list[tuple[Any, _Node]] = []

    def take(self, children: list[tuple[Any, _Node]]) -> None:
        for _, child in children:
            child.sealed = True
            self.size = min(self.size + child.size, MAX_CHECKPOINT_VALUES + 1)
            self.depth = max(self.depth, child.depth + 1)
        self.children += children


def _label(node: _Node) -> str:
    text = str(node.label) if isinstance(node.label, (str, int, float, bool)) else "?"
    return text if len(text) <= 40 else text[:40] + "..."


def check_pickle_bounds(path: Path) -> None:
    """Refuse, before anything is unpickled, a checkpoint file (torch's zip layout) whose pickle unfolds to more than
    MAX_CHECKPOINT_VALUES values (shared references counted each time they are reached), nests deeper than
    MAX_CHECKPOINT_DEPTH, holds a cycle or is over MAX_CHECKPOINT_PICKLE_BYTES: a :class:`CheckpointMismatch`
    naming the file and the field. Linear in the pickle's size (its opcodes are read, no value is built). A file
    that is no zip archive is left to torch.load, which names what is wrong with it."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = next((i for i in archive.infolist() if i.filename.endswith("data.pkl")), None)
            if info is None:
                return
            with archive.open(info) as f:
                data = f.read(MAX_CHECKPOINT_PICKLE_BYTES + 1)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return  # truncated or not torch's format: torch.load says so (CheckpointUnreadable)
    if len(data) > MAX_CHECKPOINT_PICKLE_BYTES:
        raise CheckpointMismatch(f"checkpoint file {path}: its pickle is over {MAX_CHECKPOINT_PICKLE_BYTES} bytes; "
                                 "a checkpoint teamrl writes holds far less (refused before it is read)")
    root = _scan_pickle(path, data)
    parts: list[str] = []
    node = root
    if root.depth > MAX_CHECKPOINT_DEPTH:
        what = f"nests deeper than {MAX_CHECKPOINT_DEPTH} lists/mappings"
        while len(parts) < MAX_CHECKPOINT_DEPTH:
            key, node = max(node.children, key=lambda kc: kc[1].depth)
            parts.append(key)
    elif root.size > MAX_CHECKPOINT_VALUES:
        what = f"unfolds to more than {MAX_CHECKPOINT_VALUES} values (each shared reference counted)"
        while over := [kc for kc in node.children if kc[1].size > MAX_CHECKPOINT_VALUES]:
            key, node = over[0]
            parts.append(key)
    else:
        return
    where = ".".join(parts[:12]) + (f"... ({len(parts)} levels)" if len(parts) > 12 else "") or "its content"
    raise CheckpointMismatch(f"checkpoint file {path}: {where} {what}; a checkpoint teamrl writes holds far less "
                             "(refused before it is unpickled)")


def _scan_pickle(path: Path, data: bytes) -> _Node:
    """Run the pickle ``data``'s opcodes on stand-in values (:class:`_Node`, sizes capped past the bound); the
    value it returns. A pickle that does not run, or changes a value already inside another (a cycle: teamrl
    writes none), is a :class:`CheckpointUnreadable`."""
    stack: list[_Node] = []
    marks: list[int] = []
    memo: dict[int, _Node] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif name == "DUP":
                stack.append(stack[-1])
            elif name == "STOP":
                return stack.pop()
            else:
                before, sliced = op.stack_before, []
                if pickletools.markobject in before:
                    at = marks.pop()
                    sliced, stack[at:] = stack[at:], []
                    before = before[:before.index(pickletools.markobject)]
                popped = [stack.pop() for _ in before][::-1] + sliced
                if not op.stack_after:
                    continue  # PROTO, FRAME, POP, POP_MARK
                if name in _MUTATORS:
                    node, items = popped[0], popped[1:]
                    if node.sealed or any(item is node for item in items):
                        raise ValueError("a value is changed after it was put into another one (a cycle)")
                    pairs = range(0, len(items) - 1, 2)
                    node.take([(_label(items[i]), items[i + 1]) for i in pairs]
                              + [(f"(key {_label(items[i])})", items[i]) for i in pairs] if name.startswith("SETITEM")
                              else [(str(len(node.children) + i), item) for i, item in enumerate(items)])
                else:
                    node = _Node(arg)
                    node.take([(str(i), item) for i, item in enumerate(popped)])
                stack.append(node)
        raise ValueError("the pickle has no STOP")
    except (ValueError, KeyError, IndexError) as e:
        raise CheckpointUnreadable(f"checkpoint file {path} is truncated or corrupt (its pickle does not read: "
                                   f"{' '.join(str(e).split())[:120]})") from e


def _read(path: Path, mmap: bool = False) -> Any:
    """Load a checkpoint file as tensors and plain data only (``weights_only``: unpickling can run no code), after
    :func:`check_pickle_bounds`. A file that does not load (truncated, corrupt, or holding anything else) is a
    :class:`CheckpointUnreadable` naming it."""
    check_pickle_bounds(path)
    try:
        with torch.serialization.safe_globals(_LEGACY_SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a damaged file
        if "Weights only load failed" in str(e) or isinstance(e, pickle.UnpicklingError):
            raise CheckpointUnreadable(f"checkpoint file {path} holds something other than tensors and plain data "
                                       "(loading it could run code); refused: use a checkpoint teamrl wrote") from e
        reason = " ".join(str(e).split(". ")[0].split()) or type(e).__name__
        raise CheckpointUnreadable(f"checkpoint file {path} is truncated or corrupt ({reason})") from e


def verify_checkpoint(path: Path) -> None:
    """Check that every file of the checkpoint at ``path`` reads back whole (without loading the tensors:
    memory-mapped); raise :class:`CheckpointUnreadable` naming the first that does not."""
    for f in sorted(path.glob("*.pt")):
        _read(f, mmap=f.name != "trainer_state.pt")


def checkpoint_to_resume(folder: Path, intact: bool = False) -> tuple[Path | None, list[tuple[Path, Path]]]:
    """(the checkpoint ``--resume`` continues from, [(unreadable checkpoint, where it was moved)]).

    The newest checkpoint is checked to read whole (:func:`verify_checkpoint`). When it does not:
    without ``intact`` a :class:`CheckpointUnreadable` names the file and offers the newest intact
    checkpoint (``--resume-intact``); with ``intact`` that one is returned and the unreadable newer ones
    are renamed ``unreadable_step_N`` (kept, never deleted, no longer picked up). No checkpoint: None."""
    ckpts = list_checkpoints(folder)
    bad: list[tuple[Path, CheckpointUnreadable]] = []
    good = None
    for ckpt in reversed(ckpts):
        try:
            verify_checkpoint(ckpt)
        except CheckpointUnreadable as e:
            bad.append((ckpt, e))
            continue
        good = ckpt
        break
    if not bad:
        return good, []
    first = str(bad[0][1])
    if good is None:
        raise CheckpointUnreadable(f"no intact checkpoint in {folder}: {first}" + (
            f" (and {len(bad) - 1} older)" if len(bad) > 1 else "") + "; start the run again with another name= "
            f"(or remove {folder})")
    newer = ", ".join(p.name for p, _ in bad)
    if not intact:
        raise CheckpointUnreadable(f"{first}; the newest intact checkpoint is {good.name}: resume from it with "
                                   f"--resume-intact (which keeps {newer} aside as unreadable_step_N)")
    moved = []
    for ckpt, _ in bad:
        target = ckpt.with_name(f"unreadable_{ckpt.name}")
        k = 1
        while target.exists():
            target, k = ckpt.with_name(f"unreadable_{ckpt.name}.{k}"), k + 1
        ckpt.rename(target)
        moved.append((ckpt, target))
    return good, moved


def check_run_dir(run_dir: Path) -> None:
    """Refuse, before any model loads, a run directory that cannot be created or written (a read-only file
    system, a folder this user may not write, a file in its path): a :class:`RunDirError` naming it."""
    probe = run_dir
    while not probe.exists() and probe.parent != probe:  # the nearest folder that exists
        probe = probe.parent
    if not probe.is_dir():
        raise RunDirError(
            f"run directory {run_dir}: {probe} is a file, not a folder; choose another run.dir= (or name=)"
        )
    for p in (probe, run_dir / "checkpoints"):
        if p.is_dir() and not os.access(p, os.W_OK | os.X_OK):
            why = (
                "is on a read-only file system"
                if os.statvfs(p).f_flag & os.ST_RDONLY
                else "is not writable by this user"
            )
            raise RunDirError(f"run directory {run_dir} cannot be written: {p} {why}; choose a writable run.dir= "
                              "(run.dir/name is where checkpoints and metrics go)")


class RunInUse(InputError):
    """Another process holds the run directory (its lock names its pid)."""


# run directory -> (its lock file's descriptor, holders in this process): the lock keeps other processes out; one
# process may open a run again (a test's second trainer, an evaluation of the run being trained)
_HELD: dict[Path, tuple[int, int]] = {}
LOCK_FILE = ".lock"


def lock_run_dir(run_dir: Path) -> bool:
    """Hold ``run_dir`` for this process (``run_dir/.lock``, an exclusive ``flock`` that the kernel releases when the
    process ends, however it ends). Another process holding it is a :class:`RunInUse` naming its pid. Returns whether
    this call created the directory (:func:`unlock_run_dir` removes it again on a failed start)."""
    import fcntl

    key = Path(os.path.abspath(run_dir))
    if key in _HELD:
        fd, n = _HELD[key]
        _HELD[key] = (fd, n + 1)
        return False
    created = not key.exists()
    with run_dir_writes(run_dir):
        key.mkdir(parents=True, exist_ok=True)
        fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunInUse(f"run directory {run_dir} is in use by another teamrl process (pid {holder}); wait for it to "
                       "end (or stop it), or choose another name=") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[key] = (fd, 1)
    return created


def unlock_run_dir(run_dir: Path, remove_created: bool = False) -> None:
    """Give back one hold of :func:`lock_run_dir`; the last one releases the lock. ``remove_created``: the start that
    created the directory failed, so a directory holding nothing but the lock file is removed (a refused run leaves no
    trace)."""
    key = Path(os.path.abspath(run_dir))
    if key not in _HELD:
        return
    fd, n = _HELD.pop(key)
    if n > 1:
        _HELD[key] = (fd, n - 1)
        return
    if remove_created and [p.name for p in key.iterdir()] == [LOCK_FILE]:
        (key / LOCK_FILE).unlink()
        key.rmdir()
    os.close(fd)  # closing the descriptor releases the flock


@contextmanager
def run_dir_writes(run_dir: Path) -> Iterator[None]:
    """Turn a failed write into the run directory (full, read-only, not writable) into a one-line
    :class:`RunDirError`."""
    try:
        yield
    except OSError as e:
        inside = e.filename is not None and Path(os.path.abspath(e.filename)).is_relative_to(os.path.abspath(run_dir))
        if (
            isinstance(e, InputError)
            or e.errno not in UNWRITABLE
            or not (inside or e.errno in (errno.ENOSPC, errno.EDQUOT))
        ):
            raise
        where = e.filename or run_dir
        raise RunDirError(f"run directory {run_dir}: cannot write {where} ([Errno {e.errno}] {e.strerror}); free space "
                          "or choose a writable run.dir=, then continue with teamrl train ... --resume") from e


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.pt").is_file()
    ]
    return [p for _, p in sorted(found)]


# ---- the warm start: RUN_DIR/warm_start/step_N (never rotated) and RUN_DIR/warm_start.json (what it is) -------
WARM_START_DIR = "warm_start"
WARM_START_FILE = "warm_start.json"


def record_warm_start(run_dir: Path, checkpoint: Path, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keep the warm start ``checkpoint`` of ``run_dir`` for comparisons: a copy in ``RUN_DIR/warm_start/`` (out of
    ``checkpoints/``, whose rotation would delete it once RL saves two steps) and ``RUN_DIR/warm_start.json``
    (its path relative to the run, its step and ``info``: what it was trained on). A warm start already kept stays as
    it is; ``info`` is added to its record. Returns the record."""
    run_dir, checkpoint = Path(run_dir), Path(checkpoint)
    kept = run_dir / WARM_START_DIR / checkpoint.name
    if not (kept / "trainer_state.pt").is_file():
        tmp = kept.with_name(f".tmp_{kept.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(checkpoint, tmp)
        shutil.rmtree(kept, ignore_errors=True)
        tmp.rename(kept)
    record = warm_start_of(run_dir) or {}
    record.update(info or {})
    record.update({"checkpoint": f"{WARM_START_DIR}/{kept.name}", "step": int(kept.name.rsplit("_", 1)[-1])})
    (run_dir / WARM_START_FILE).write_text(json.dumps(record, indent=1) + "\n")
    return record


def warm_start_of(run_dir: Path) -> dict[str, Any] | None:
    """The warm start recorded for ``run_dir`` (:func:`record_warm_start`), or None: a run without one, or a record
    that is not a JSON object naming its checkpoint (a one-line :class:`CheckpointMismatch`)."""
    path = Path(run_dir) / WARM_START_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointMismatch(f"{path}: not JSON ({e}); teamrl sft writes it: remove it, or warm-start again"
                                 ) from None
    if not isinstance(record, dict) or not isinstance(record.get("checkpoint"), str):
        raise CheckpointMismatch(f"{path}: expected an object with the warm start's checkpoint path, as teamrl sft "
                                 "writes it; remove it, or warm-start again")
    return record


def describe_warm_start(record: dict[str, Any], run_dir: Path | None = None) -> str:
    """One line on a warm start record (:func:`warm_start_of`): whether RL resumed from it, where its weights are
    (under ``run_dir`` when given, else relative to the run) and what it was trained on, as far as it says."""
    where = str(Path(run_dir) / record["checkpoint"]) if run_dir is not None else record["checkpoint"]
    counts = [f"{v} {k if v != 1 else k[:-1]}" for k in ("demonstrations", "epochs")
              if isinstance(v := record.get(k), int)]
    how = ": ".join(str(record[k]) for k in ("trained_by", "source") if record.get(k))
    how = "; ".join(x for x in (how, ", ".join(counts)) if x)
    lead = f"warm start: RL resumed from {where}" if record.get("rl_resumed_from") else (
        f"warm start: {where} (RL has not resumed from it yet)")
    return lead + (f" ({how})" if how else "")


def warm_start_checkpoint(run_dir: Path) -> Path | None:
    """The folder of ``run_dir``'s warm start weights, or None without a warm start (one whose weights are gone
    is a one-line :class:`InputFileMissing`)."""
    record = warm_start_of(run_dir)
    if record is None:
        return None
    path = Path(run_dir) / record["checkpoint"]
    if not (path / "trainer_state.pt").is_file():
        raise InputFileMissing(f"{Path(run_dir) / WARM_START_FILE} names the warm start {path}, which holds no "
                               "checkpoint (trainer_state.pt; moved or deleted?); evaluate without it: "
                               "--method team,untrained")
    return path


def began_from_warm_start(run_dir: Path, resume_from: Path | None) -> bool:
    """Whether the run in ``run_dir`` began from a warm start: one is recorded (``warm_start.json``), or the checkpoint
    it resumes from is one (an older ``teamrl sft``'s ``step_000000``, recorded once RL starts)."""
    if warm_start_of(run_dir) is not None:
        return True
    if resume_from is None:
        return False
    state = _read(resume_from / "trainer_state.pt")
    return isinstance(state, dict) and bool(state.get("warm_start"))


def warm_start_weights(run_dir: Path,
                       policies: PolicyRouter | PolicyStates) -> dict[str, dict[str, torch.Tensor]] | None:
    """Each policy's weights in ``run_dir``'s warm start (:func:`warm_start_checkpoint`), checked against
    ``policies`` like a resume; None when the run has no warm start."""
    path = warm_start_checkpoint(run_dir)
    if path is None:
        return None
    states = _states(policies)
    out = {}
    for name in states.policy_names():
        f = path / f"policy_{name}.pt"
        if not f.is_file():
            raise InputFileMissing(f"warm start {path} has no weights for policy {name!r} ({f.name}); was the policy "
                                   "mode changed since teamrl sft?")
        weights = _read(f)
        _check_weights(f, weights, states.state(name)[0])
        out[name] = weights
    return out


def resolve_checkpoint(path: Path, flag: str) -> tuple[Path, Path]:
    """(run directory, checkpoint folder) of ``path``: a run directory (its newest ``checkpoints/step_N``) or a
    checkpoint folder itself (``runs/x/checkpoints/step_000004``, ``runs/x/best/step_N``,
    ``runs/x/warm_start/step_000000``: its run is two folders up). Anything else is a one-line
    :class:`InputFileMissing` naming ``flag``."""
    path = Path(path)
    if (path / "trainer_state.pt").is_file():
        return path.parent.parent, path
    ckpts = list_checkpoints(path / "checkpoints")
    if ckpts:
        return path, ckpts[-1]
    what = "does not exist" if not path.exists() else "holds neither checkpoints/step_N nor a trainer_state.pt"
    raise InputFileMissing(f"{flag} {path}: {what}; give a run directory (runs/NAME) or a checkpoint folder "
                           "(runs/NAME/checkpoints/step_N)")


# what the weights' names and shapes follow: a resume under other values cannot restore them
RESUME_KEYS = ("model", "policy.mode", "policy.lora", "policy.lora.r", "policy.lora.target_modules")


def settings_mismatch(run_dir: Path, cfg: Any) -> tuple[str, Any, Any, Path] | None:
    """(key, the run's value, ``cfg``'s value, the run's config file) of the first :data:`RESUME_KEYS` key on which
    ``cfg`` differs from what ``run_dir``'s checkpoints were trained with (its ``config.yaml``); None when none
    does, or the run has no readable ``config.yaml`` (left to the tensor checks of :func:`load_checkpoint`)."""
    from teamrl.core.config import ConfigError, config_to_dict, read_yaml_mapping

    saved_file = run_dir / "config.yaml"
    if not saved_file.is_file():
        return None
    try:
        saved = read_yaml_mapping(saved_file, "the run's config")
    except ConfigError:
        return None
    now = config_to_dict(cfg)

    def get(tree: Any, dotted: str) -> tuple[bool, Any]:
        for part in dotted.split("."):
            if not isinstance(tree, dict) or part not in tree:
                return False, None
            tree = tree[part]
        return True, tree

    for key in RESUME_KEYS:
        (had, old), (_, new) = get(saved, key), get(now, key)
        if not had or (key == "policy.lora" and old is not None and new is not None):
            continue  # policy.lora itself: only null against settings (its keys are compared one by one)
        if old != new:
            return key, old, new, saved_file
    return None


def check_resume_settings(run_dir: Path, cfg: Any) -> None:
    """Refuse, before any model loads, a ``--resume`` whose model or LoRA settings differ from those the run's
    checkpoints were trained with (its ``config.yaml``): a :class:`CheckpointMismatch` naming the key and both values.
    A run without a readable ``config.yaml`` is left to the tensor checks of :func:`load_checkpoint`."""
    mismatch = settings_mismatch(run_dir, cfg)
    if mismatch is not None:
        import yaml

        key, old, new, saved_file = mismatch
        as_given = yaml.safe_dump(old, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        raise CheckpointMismatch(
            f"--resume: {key} is {new!r}, but the checkpoints of {run_dir} were trained with "
            f"{old!r} ({saved_file}); resume with {key}={as_given}, or start a new run (another name=)"
        )


def _kind(obj: Any) -> str:
    return {dict: "a mapping", list: "a list", tuple: "a tuple"}.get(type(obj), type(obj).__name__)


def _described(value: Any) -> str:
    """``value`` for a one-line message, bounded whatever it is: a short number or string as written, else its
    kind and size (no repr() of a value that could unfold without end)."""
    if isinstance(value, float) or (isinstance(value, int) and abs(value) < 10**18):
        return repr(value)
    if isinstance(value, int):
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value)} characters"
    return _kind(value)


def _check_weights(f: Path, weights: Any, expected: dict[str, torch.Tensor]) -> None:
    """``weights`` (read from ``f``) are the tensors of the policy whose own are ``expected``: the same names,
    shapes."""
    if not isinstance(weights, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
    ):
        raise CheckpointMismatch(
            f"checkpoint file {f}: expected a mapping of weight name -> tensor, got {_kind(weights)}"
        )
    extra = [k for k in weights if k not in expected]
    if extra:
        raise CheckpointMismatch(f"checkpoint file {f}: holds {_described(extra[0])}, which this run's policy does not "
                                 f"have ({len(extra)} such); it was written for another model or policy.lora")
    missing = [k for k in expected if k not in weights]
    if missing:
        raise CheckpointMismatch(
            f"checkpoint file {f}: lacks {missing[0]!r} of shape {list(expected[missing[0]].shape)} "
            f"({len(missing)} missing); it was written for another model or policy.lora"
        )
    for k, want in expected.items():
        if tuple(weights[k].shape) != tuple(want.shape):
            raise CheckpointMismatch(f"checkpoint file {f}: tensor {k} has shape {list(weights[k].shape)}, this run's "
                                     f"policy expects {list(want.shape)} (another model or policy.lora.r wrote it?)")


def _check_optimizer(f: Path, optim: Any, expected: dict[str, torch.Tensor]) -> None:
    """``optim`` (read from ``f``) is an optimizer state of the parameters ``expected`` (in order): one entry per
    parameter, moments of its shape."""
    groups = optim.get("param_groups") if isinstance(optim, dict) else None
    state = optim.get("state") if isinstance(optim, dict) else None
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointMismatch(
            f"checkpoint file {f}: expected an optimizer state (a mapping of state and param_groups), "
            f"got {_kind(optim)}"
        )
    for j, g in enumerate(groups):  # hyperparameters: numbers, flags, names, betas; params: parameter indexes
        for key, v in g.items():
            ok = (all(isinstance(p, int) for p in v) if key == "params" else
                  v is None or isinstance(v, (int, float, str, torch.Tensor)) or (
                      isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v)))
            if not ok:
                raise CheckpointMismatch(f"checkpoint file {f}: param_groups.{j}.{_described(key)} must be a number, "
                                         f"a name or a list of numbers, got {_kind(v)}")
    count = sum(len(g["params"]) for g in groups)
    if count != len(expected):
        raise CheckpointMismatch(f"checkpoint file {f}: holds the state of {count} parameters, this run's policy has "
                                 f"{len(expected)}")
    shapes = [tuple(t.shape) for t in expected.values()]
    for i, entry in state.items():
        if not isinstance(i, int) or not 0 <= i < count or not isinstance(entry, dict):
            raise CheckpointMismatch(f"checkpoint file {f}: state entry {_described(i)} is not a parameter's "
                                     f"(0 to {count - 1})")
        for key, v in entry.items():
            if not isinstance(v, (torch.Tensor, int, float)):  # moments and step counts; torch walks anything else
                raise CheckpointMismatch(f"checkpoint file {f}: state.{i}.{_described(key)} must be a tensor or a "
                                         f"number, got {_kind(v)}")
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shapes[i]:
                raise CheckpointMismatch(f"checkpoint file {f}: {key} of parameter {i} has shape {list(v.shape)}, this "
                                         f"run's parameter {list(expected)[i]} is {list(shapes[i])}")


def _check_trainer_state(f: Path, state: Any) -> None:
    """``state`` (read from ``f``) is a trainer state as :func:`save_checkpoint` writes it."""
    if not isinstance(state, dict):
        raise CheckpointMismatch(f"checkpoint file {f}: expected a mapping with step, data_position and rng (as teamrl "
                                 f"writes it), got {_kind(state)}")
    for key in ("step", "data_position"):
        v = state.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointMismatch(
                f"checkpoint file {f}: {key} must be an integer >= 0, got "
                f"{'nothing' if key not in state else _described(v)}; expected step, data_position and rng"
            )
    if not isinstance(state.get("rng"), dict):
        raise CheckpointMismatch(f"checkpoint file {f}: rng must be the mapping of RNG states teamrl writes, got "
                                 f"{'nothing' if 'rng' not in state else _kind(state['rng'])}")
    if "algorithm" in state and not isinstance(state["algorithm"], dict):
        raise CheckpointMismatch(f"checkpoint file {f}: algorithm must be a mapping, got {_kind(state['algorithm'])}")


def load_checkpoint(path: Path, policies: PolicyRouter | PolicyStates) -> dict[str, Any]:
    """Restore policies (of a router or a learner), optimizers and RNG states from ``path``; return the trainer
    state.

    Every file is read and checked against this run's policies (names and shapes of the tensors, the trainer state's
    keys) before anything is restored: a mismatch is a :class:`CheckpointMismatch` naming the file and the entry."""
    states = _states(policies)
    state_file = path / "trainer_state.pt"
    state = _read(state_file)
    _check_trainer_state(state_file, state)
    loaded = {}
    for name in states.policy_names():
        f = path / f"policy_{name}.pt"
        if not f.is_file():
            raise InputFileMissing(
                f"checkpoint {path} has no weights for policy {name!r} ({f.name}); was the policy mode changed?"
            )
        # a GPU run resumes on a CPU too (_read maps to the CPU)
        weights, optim = _read(f), _read(path / f"optimizer_{name}.pt")
        expected = states.state(name)[0]
        _check_weights(f, weights, expected)
        _check_optimizer(path / f"optimizer_{name}.pt", optim, expected)
        loaded[name] = (weights, optim)
    rng = rng_state()
    try:
        set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
        set_rng_state(rng)
        raise CheckpointMismatch(f"checkpoint file {state_file}: its rng entry is not the RNG states teamrl writes "
                                 f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from e
    for name, (weights, optim) in loaded.items():
        states.load_state(name, weights, optim)
    return state

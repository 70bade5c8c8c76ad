"""Sandbox users: the per-run uids a run leases, and killing everything a run left behind
(by its uid, or without one by its session)."""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Sandbox users: one uid (and gid) per concurrent run, leased under a lock file, so runs
# cannot signal, ptrace or read each other, RLIMIT_NPROC is per run, and everything a run
# leaves behind can be found by its uid and killed. Chosen far above regular and
# container-mapped ids.
SANDBOX_UID_BASE = 1_900_000_000
SANDBOX_UID_SLOTS = 4096
_LOCK_DIR = Path("/run/teamrl-sandbox")


@dataclass
class Lease:
    uid: int
    gid: int
    slot: int
    fd: int | None


class _UidLeases:
    """Hands out unused sandbox uids; a flock per uid coordinates separate processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[int] = set()
        self._next = secrets.randbelow(SANDBOX_UID_SLOTS)
        self._dir: Path | None = None
        self._dir_checked = False

    def _lock_dir(self) -> Path | None:
        if not self._dir_checked:
            self._dir_checked = True
            try:
                _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
                st = os.lstat(_LOCK_DIR)
                # Only trust a real directory that root owns and nobody else can write.
                if stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022:
                    self._dir = _LOCK_DIR
            except OSError:
                self._dir = None
        return self._dir

    def acquire(self) -> Lease:
        with self._lock:
            lock_dir = self._lock_dir()
            for k in range(SANDBOX_UID_SLOTS):
                slot = (self._next + k) % SANDBOX_UID_SLOTS
                if slot in self._held:
                    continue
                uid = SANDBOX_UID_BASE + slot
                fd = None
                if lock_dir is not None:
                    try:
                        fd = os.open(
                            lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                        )
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        if fd is not None:
                            os.close(fd)
                        continue  # another process holds it
                self._held.add(slot)
                self._next = slot + 1
                return Lease(uid=uid, gid=uid, slot=slot, fd=fd)
        raise RuntimeError(f"all {SANDBOX_UID_SLOTS} sandbox uids are in use")

    def release(self, lease: Lease) -> None:
        with self._lock:
            if lease.fd is not None:
                os.close(lease.fd)
            self._held.discard(lease.slot)


LEASES = _UidLeases()


def _tasks_of_user(uid: int) -> list[int]:
    """Pids of live (not zombie) processes whose real or effective uid is ``uid``."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", "rb") as fh:
                text = fh.read(2048)
        except OSError:
            continue
        state = re.search(rb"^State:\s*(\S)", text, re.M)
        ids = re.search(rb"^Uid:\s*(\d+)\s+(\d+)", text, re.M)
        if ids and uid in (int(ids.group(1)), int(ids.group(2))) and not (state and state.group(1) in b"ZX"):
            pids.append(int(entry.name))
    return pids


def kill_user(uid: int) -> bool:
    """SIGKILL every process of the sandbox user that /proc shows, until it shows none; True
    if there was any. (Reads of /proc can race with fork: see kill_user_atomically.)"""
    found = False
    for attempt in range(200):
        pids = _tasks_of_user(uid)
        if not pids:
            return found
        found = True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(min(0.001 * (attempt + 1), 0.02))
    return found


def kill_user_atomically(uid: int, gid: int) -> None:
    """kill(-1, SIGKILL) as the sandbox user: the kernel signals all of its processes under
    one lock, so a fork in flight is cancelled and a process that forks and exits in a loop
    cannot slip between the /proc reads of :func:`kill_user`."""
    for shell in ("/bin/sh", "/usr/bin/sh"):
        if os.path.exists(shell):
            try:
                subprocess.run(
                    [shell, "-c", "kill -9 -1"],
                    user=uid, group=gid, extra_groups=[],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env={}, cwd="/", timeout=5, check=False,
                )
            except (OSError, subprocess.SubprocessError):
                pass
            return


def kill_session(sid: int) -> None:
    """Without a sandbox user: SIGKILL what is left of the run's session and process group."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue

"""The TCP sockets a set of processes listen on, read from ``/proc`` (Linux): for tests that check what a run binds."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

WILDCARDS = {"0.0.0.0", "::"}


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(children.get(p, []))
    return found


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp{,6} write each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def listening(pids: set[int]) -> dict[tuple[str, int], set[int]]:
    """(address, port) -> the processes of ``pids`` listening there."""
    inodes: dict[str, set[int]] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.setdefault(target[8:-1], set()).add(pid)
        except OSError:  # gone, or not ours to read
            continue
    out: dict[tuple[str, int], set[int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # state LISTEN
                out.setdefault(_address(f[1]), set()).update(inodes[f[9]])
    return out

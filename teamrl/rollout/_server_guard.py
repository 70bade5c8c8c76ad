"""A guard between teamrl and a server it starts, so that the server never outlives teamrl.

    python -m teamrl.rollout._server_guard --parent PID --log FILE [--grace S] -- COMMAND...

The guard starts ``COMMAND`` in a process group (session) of its own, its output appended to
``FILE``, prints the server's pid on its own stdout, and waits. It ends the server's **whole
group** (vLLM's API server, its engine core, its workers: the engine core and workers outlive a
killed API server; measured with vLLM 0.32) when

- it gets SIGTERM or SIGHUP (teamrl stopping the server: SIGTERM to the group, ``--grace``
  seconds, then SIGKILL), or
- teamrl's process dies in any way, SIGKILL included: the kernel sends the guard SIGTERM
  (``prctl(PR_SET_PDEATHSIG)``), and the same shutdown follows.

- the guard itself is killed outright (SIGKILL; Ray does that to an actor's child processes when the
  actor dies): a watcher process the guard forks sees it gone and ends the group the same way.

It exits with the server's exit status (128 + N for a signal N). Only the standard library, so
that it starts in milliseconds; Linux only (``prctl``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent (thread) exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pgid``; False when no process of it is left."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _start_sentinel(pgid: int, grace: float) -> int:
    """Fork a watcher that ends the server's group should this guard be killed outright (SIGKILL cannot be handled
    here): Ray, for one, SIGKILLs an actor's child processes when the actor dies. The server would then get its own
    parent-death signal, but what it started (vLLM's engine core) would not. The watcher polls for the guard's death
    and ends the group as the guard would (SIGTERM, ``grace`` seconds, SIGKILL); after an orderly stop the group is
    already gone and it just exits."""
    guard = os.getpid()
    child = os.fork()
    if child != 0:
        return child
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # signals meant for the guard (its process group) are not for it
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 1)  # the trainer reads the server's pid from the guard's stdout: hold no end of that pipe
        while os.getppid() == guard:
            time.sleep(0.2)
        if _kill_group(pgid, signal.SIGTERM):
            deadline = time.monotonic() + grace
            while _kill_group(pgid, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            _kill_group(pgid, signal.SIGKILL)
    finally:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Run the guard (see the module docstring); returns the server's exit status."""
    p = argparse.ArgumentParser(prog="python -m teamrl.rollout._server_guard")
    p.add_argument("--parent", type=int, required=True, help="pid of the process whose death ends the server")
    p.add_argument("--log", required=True, help="file the server's stdout and stderr are appended to")
    p.add_argument(
        "--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL of the server's group"
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    ns = p.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not command:
        p.error("no server command after --")
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGHUP, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle: it stops the server in order
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != ns.parent:  # the parent died before prctl took effect
        return 1
    with open(ns.log, "ab", buffering=0) as log:
        # its own session: Ctrl-C at the terminal reaches the trainer only; SIGTERM if the guard itself is killed
        server = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=lambda: _die_with_parent(signal.SIGTERM))
    print(server.pid, flush=True)
    sentinel = _start_sentinel(server.pid, ns.grace)
    while server.poll() is None and not stop:
        time.sleep(0.2)
    # a server that exited by itself: 5 s for what it started to follow; one told to stop: its whole grace
    deadline = time.monotonic() + (ns.grace if server.poll() is None else min(ns.grace, 5.0))
    if server.poll() is None:
        _kill_group(server.pid, signal.SIGTERM)
    while server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    # what is left of the group: the engine core and workers of a server that died, or that still shut down
    while _kill_group(server.pid, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    _kill_group(server.pid, signal.SIGKILL)
    rc = server.wait()
    # an orderly end: the watcher has nothing left to guard; gone (and reaped) before the guard, whose exit the
    # trainer waits for, so that no process naming the server's command outlives the stop
    os.kill(sentinel, signal.SIGKILL)
    os.waitpid(sentinel, 0)
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main())

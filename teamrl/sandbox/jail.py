"""The container a sandbox run lives in: the bubblewrap command line, the interpreter and
first stage it starts, and the environment it gets. Nothing here starts a process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from teamrl.sandbox.limits import SandboxLimits

# After a container is killed, what is left in its pipes is read for at most this long.
DRAIN_SECONDS = 1.0
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONFAULTHANDLER": "1",
}

_harness_source: str | None = None
_setup_source: str | None = None


def _harness() -> str:
    """The harness's program: ``_harness_guards.py``'s text (the isolation check and the audit hook, globals of
    the harness), then ``_harness.py``'s (which ends by calling the harness); one ``-c`` argument."""
    global _harness_source
    if _harness_source is None:
        here = Path(__file__)
        _harness_source = "\n".join(
            here.with_name(name).read_text(encoding="utf-8") for name in ("_harness_guards.py", "_harness.py")
        )
    return _harness_source


def _setup() -> str:
    global _setup_source
    if _setup_source is None:
        _setup_source = (Path(__file__).with_name("_setup.py")).read_text(encoding="utf-8")
    return _setup_source


def _interpreter() -> list[str]:
    # -s -S: no site-packages; -B: no .pyc writes; -P (3.11+): no script/cwd on sys.path.
    # The environment is built from scratch (PROGRAM_ENV), so -E is not needed and
    # PYTHONHASHSEED=0 keeps set/dict iteration reproducible across runs. The first stage
    # (_setup.py) builds the isolation, then execs the harness (its argument) the same way.
    flags = ["-s", "-S", "-B"]
    if sys.version_info >= (3, 11):
        flags.append("-P")
    return [os.path.realpath(sys.executable), *flags, "-c", _setup(), _harness()]


# Fixed places only: a PATH lookup would let the caller's environment choose the jailer.
_BWRAP_PATHS = ("/usr/bin/bwrap", "/bin/bwrap", "/usr/local/bin/bwrap")
_NAMESPACES = ("pid", "mnt", "ipc", "uts")


def bwrap_path() -> str:
    """The bubblewrap executable; RuntimeError (naming the package) when it is missing."""
    for path in _BWRAP_PATHS:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        "bubblewrap is not installed (looked for " + ", ".join(_BWRAP_PATHS) + "), so the run was refused; "
        "install the Debian package bubblewrap (`make setup` does it as root)"
    )


def bwrap_exit_code(code: int) -> int:
    """bwrap exits with 128 + N when its command was killed by signal N: report -N, as for a
    direct child."""
    return -(code - 128) if 128 < code < 128 + 65 else code


def host_namespace_inodes(network: str) -> dict[str, int]:
    """Inode numbers of this process's namespaces: the harness checks that its own differ."""
    names = _NAMESPACES + (("net",) if network in ("auto", "netns") else ())
    return {name: os.stat(f"/proc/self/ns/{name}").st_ino for name in names}


def _visible_tree() -> list[str]:
    """bwrap arguments exposing, read-only, just what the interpreter needs: /usr (and the
    merged-/usr links) and the interpreter's own prefix. Everything else of the host (/run,
    /home, /work, /etc, its sockets) is absent from the run's file system."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefixes = {
        sys.base_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    }
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if prefix != "/usr" and not prefix.startswith("/usr/"):
            # Traversable parents (bwrap would copy /root's 0700), then the prefix itself.
            parts = prefix.strip("/").split("/")[:-1]
            for depth in range(1, len(parts) + 1):
                args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:depth])]
            args += ["--ro-bind", prefix, prefix]
    return args


def bwrap_command(limits: SandboxLimits, network: str, as_root: bool) -> list[str]:
    """The whole command line: bwrap with its own pid, mount, ipc and uts namespaces (and
    network, unless a weaker network mode is forced), a user namespace when the caller is
    not root, the read-only tree of :func:`_visible_tree`, a private /proc, a minimal /dev,
    tmpfs /tmp and /dev/shm (/var/tmp and /run/lock point to /tmp), the rest read-only, and
    death with the caller; then the interpreter with the first stage (``_setup.py``), which
    mounts the run's own size- and file-limited, noexec tmpfs over /tmp and /dev/shm (bwrap's
    /tmp only stages the execute-only interpreter) and needs CAP_SYS_ADMIN in the run's user
    namespace for it when the caller is not root (it clears every capability before the
    harness starts)."""
    tmp_bytes = limits.max_disk_bytes * 3 // 4
    shm_bytes = limits.max_disk_bytes - tmp_bytes
    args = [
        bwrap_path(),
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
    ]
    if network in ("auto", "netns"):
        args.append("--unshare-net")
    if not as_root:
        args += ["--unshare-user", "--cap-add", "CAP_SYS_ADMIN"]
    args += _visible_tree()
    args += ["--proc", "/proc", "--dev", "/dev"]
    staging = max(tmp_bytes, os.path.getsize(os.path.realpath(sys.executable)) + (1 << 20))
    args += ["--perms", "1777", "--size", str(staging), "--tmpfs", "/tmp"]
    args += ["--perms", "1777", "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    args += ["--symlink", "/tmp", "/var/tmp", "--dir", "/run", "--symlink", "/tmp", "/run/lock"]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    return args + _interpreter()

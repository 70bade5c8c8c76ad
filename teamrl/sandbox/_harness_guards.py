"""The harness's guards, run inside every sandbox process before the program. teamrl never imports this module.

``jail.py`` sends this file's text followed by ``_harness.py``'s as the one program the first stage
(``_setup.py``) execs, so these functions are globals of the harness: :func:`_isolate` (with
:func:`_check_mounts`) checks the isolation the first stage built, and :func:`_make_audit_hook` builds the
irremovable audit hook that refuses :data:`NATIVE_MODULES` and the other easy routes to the harness or the
host. See ``_harness.py`` for the order of events and what each guard is for.
"""

# Modules that call native code or start a subinterpreter (which has no audit hook): refused
# under any dotted name. The first stage (_setup.py) also puts /dev/null in their files' place.
NATIVE_MODULES = frozenset(
    {
        "ctypes", "_ctypes", "_ctypes_test", "cffi", "_cffi_backend",
        "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testsinglephase",
        "_testimportmultiple", "_testclinic", "_xxtestfuzz",
        "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues",
    }
)


def _make_audit_hook(block_network, extension_dirs):
    """An audit hook (irremovable) refusing the easy routes to the harness or the host.
    Imports are checked by the module's identity: every dotted segment of its name, and for an
    extension module (``_imp.create_dynamic``, whatever loader or spec led there) the file it
    opens, which must be the same-named file directly in one of ``extension_dirs`` (the
    interpreter's own lib-dynload)."""
    denied_events = frozenset(
        {
            "sys.settrace",  # a tracer can jump over a failing assert
            "sys.setprofile",
            "sys._current_frames",  # frames of the harness thread
            "sys._current_exceptions",
            "sys.addaudithook",
            "gc.get_objects",  # a way to the harness's closures
            "gc.get_referrers",
            "gc.get_referents",
            "cpython.PyInterpreterState_New",  # a subinterpreter has no audit hook
        }
    )
    denied_modules = NATIVE_MODULES
    if block_network:
        # Without kernel help, a fresh interpreter started by the program would have no hook.
        denied_modules = denied_modules | {"_posixsubprocess"}
    exec_events = frozenset({"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "pty.spawn"})

    def hook(
        event,
        args,
        _type=type,
        _str=str,
        _int=int,
        _len=len,
        _tuple=tuple,
        _isinstance=isinstance,
        _partition=str.partition,
        _rpartition=str.rpartition,
        _split=str.split,
        _startswith=str.startswith,
        _RuntimeError=RuntimeError,
        _denied_events=denied_events,
        _denied_modules=denied_modules,
        _extension_dirs=frozenset(extension_dirs),
        _exec_events=exec_events,
        _block_network=block_network,
    ):
        if event in _denied_events:
            raise _RuntimeError(f"sandbox: {event} is not allowed")
        if event == "import":
            name = args[0] if args else None
            if _type(name) is not _str:
                raise _RuntimeError("sandbox: importing this module is not allowed")
            segments = _split(name, ".")
            for segment in segments:
                if segment in _denied_modules:
                    raise _RuntimeError(f"sandbox: importing {segment} is not allowed")
            path = args[1] if _len(args) > 1 else None
            if path is not None:  # an extension module: the file it is loaded from
                if _type(path) is not _str:
                    raise _RuntimeError("sandbox: loading native code from this file is not allowed")
                folder, _, filename = _rpartition(path, "/")
                if folder not in _extension_dirs or _partition(filename, ".")[0] != segments[-1]:
                    raise _RuntimeError(f"sandbox: loading native code from {path} is not allowed")
        elif _block_network:
            if event == "socket.__new__":
                family = args[1] if _type(args) is _tuple and _len(args) > 1 else None
                if _type(family) is not _int and _isinstance(family, _int):
                    family = _int.__int__(family)
                if family != 1:  # AF_UNIX stays usable (multiprocessing needs it)
                    raise _RuntimeError("sandbox: network sockets are not allowed")
            elif event in _exec_events:
                raise _RuntimeError("sandbox: starting programs is not allowed here")

    return hook


def _isolate(payload):
    """Check the isolation the first stage (``_setup.py``) built, before the program: this
    process never imports ctypes, so it can only verify, and any difference stops the run."""
    import os
    import sys

    limits = payload["limits"]
    uid, gid = payload["uid"], payload["gid"]
    mode = payload["network"]

    for name, host_inode in payload["host_namespaces"].items():
        if os.stat(f"/proc/self/ns/{name}").st_ino == host_inode:
            raise OSError(f"the run shares the host's {name} namespace")
    network = "netns" if "net" in payload["host_namespaces"] else ("seccomp" if mode == "seccomp" else "audit-hook")
    _check_mounts(limits["max_disk_bytes"])
    with open("/proc/self/status") as fh:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
    if status.get("NoNewPrivs") != "1":
        raise OSError("no_new_privs is not set")
    held = [k for k in ("CapInh", "CapPrm", "CapEff", "CapAmb") if int(status.get(k, "0"), 16) != 0]
    if held:
        raise OSError(f"the run's process still holds capabilities ({', '.join(held)})")
    if status.get("Seccomp") != "2" and (mode == "seccomp" or os.uname().machine in ("x86_64", "aarch64")):
        raise OSError("the seccomp filter is not installed")
    if uid is not None and (os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid)):
        raise OSError("the run's process does not run as its own user")
    # Not dumpable (its executable is execute-only): /proc/self/mem is root's, ptrace refused.
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except PermissionError:
        pass
    else:
        os.close(fd)
        raise OSError("the run's process is dumpable (its memory is open to it through /proc/self/mem); "
                      "the host's fs.suid_dumpable must be 0 or 2")
    built_in = NATIVE_MODULES.intersection(sys.builtin_module_names)
    if built_in:
        raise OSError(
            f"this interpreter has {', '.join(sorted(built_in))} built in, "
            "which the sandbox cannot keep from the program"
        )
    if os.getppid() != 1:
        os._exit(72)
    os.chdir("/tmp")
    os.environ["HOME"] = "/tmp"
    os.environ["TMPDIR"] = "/tmp"
    return {"network": network, "filesystem": "private-tmpfs", "uid": uid}


def _check_mounts(max_disk_bytes):
    """Fail unless the only writable file systems are the run's own: its size- and
    file-limited, noexec tmpfs /tmp and /dev/shm (together at most ``max_disk_bytes`` and
    ``max_disk_bytes`` / 4096 files), its /proc, /dev/pts and the device nodes of /dev."""
    import os

    writable_places = {"/tmp", "/dev/shm", "/proc", "/dev/pts"}
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            fields = line.split()
            point, options = fields[4], fields[5].split(",")
            fstype = fields[fields.index("-") + 1]
            if "rw" not in options or point in writable_places:
                continue
            if fstype == "devtmpfs" and point in (
                "/dev/null",
                "/dev/zero",
                "/dev/full",
                "/dev/random",
                "/dev/urandom",
                "/dev/tty",
            ):
                continue  # device nodes: writing to them stores nothing
            raise OSError(f"{point} ({fstype}) is writable in the run's file system")
    total = files = 0
    for place in ("/tmp", "/dev/shm"):
        st = os.statvfs(place)
        total += st.f_blocks * st.f_frsize
        files += st.f_files
        if not st.f_flag & os.ST_NOEXEC:
            raise OSError(f"{place} is not mounted noexec")
    if total > max_disk_bytes + 2 * 4096:
        raise OSError(f"/tmp and /dev/shm hold {total} bytes, more than max_disk_bytes={max_disk_bytes}")
    if files > max_disk_bytes // 4096 + 32:
        raise OSError(f"/tmp and /dev/shm hold up to {files} files, more than max_disk_bytes={max_disk_bytes} allows")

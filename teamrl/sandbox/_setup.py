"""The first stage of every sandbox process: it builds the run's isolation, then execs the harness.

teamrl never imports this module. bubblewrap starts ``python -s -S -B -c <this file's text>
<the harness's text>`` as pid 2 of the run's pid namespace, with the privileges bubblewrap left
it: root (the caller is root) or CAP_SYS_ADMIN in the run's own user namespace (the caller is
not). With them, and with ctypes, this stage:

1. reads the payload from stdin and keeps it for the harness in an anonymous file that becomes
   the harness's stdin (the harness reads it, then replaces fd 0);
2. enters a mount namespace of its own and mounts there, over what bubblewrap built:
   - an execute-only copy of the interpreter over the interpreter's own path. A process whose
     executable it cannot read is made non-dumpable by the kernel at exec, so the harness and
     the program (one process) get a /proc/self/mem only root may open, and no ptrace;
   - /dev/null over the interpreter's modules that call native code or start a subinterpreter
     (a subinterpreter has no audit hook): ``_ctypes``, ``_cffi_backend``, the ``_test*``
     modules, ``_xxsubinterpreters``...;
   - the run's /tmp and /dev/shm: tmpfs with ``size=`` (3/4 and 1/4 of max_disk_bytes) and
     ``nr_inodes=`` (each file or directory costs a 4 KiB share of it), noexec, nosuid, nodev;
3. sets RLIMIT_CPU/FSIZE/CORE/NOFILE/NPROC, drops to the run's uid (root) or clears every
   capability (user namespace), and sets the parent-death signal;
4. installs a seccomp filter: memfd_create and shmget (memory that no rlimit counts) kill the
   process, io_uring is refused, and in the "seccomp" network mode so are sockets other than
   AF_UNIX;
5. execs the harness (``_harness_guards.py`` then ``_harness.py``, one program) from the
   execute-only interpreter. The program's process therefore never had ctypes loaded (none of its
   types is left to find from ``object``), holds no capability, and can undo none of the above;
   the harness checks it all before the program.

Any failure before the exec is reported as a setup-error record on the results fd and the
process exits 70: the run is refused, never run with less isolation.
"""

# Modules that call native code or start a subinterpreter: hidden here, refused by the
# harness's audit hook under any dotted name (the same set is in _harness_guards.py).
NATIVE_MODULES = frozenset(
    {
        "ctypes", "_ctypes", "_ctypes_test", "cffi", "_cffi_backend",
        "_testcapi", "_testinternalcapi", "_testbuffer", "_testmultiphase", "_testsinglephase",
        "_testimportmultiple", "_testclinic", "_xxtestfuzz",
        "_xxsubinterpreters", "_xxinterpchannels", "_interpreters", "_interpchannels", "_interpqueues",
    }
)
# A file or directory of the run's tmpfs costs this much of max_disk_bytes (nr_inodes).
INODE_BYTES = 4096


def _setup():
    import marshal
    import os
    import sys

    harness_source = sys.argv[1]
    data = sys.stdin.buffer.read()
    payload = marshal.loads(data)
    nonce, results_fd = payload["nonce"], payload["results_fd"]

    def fail(message):
        for a, b in (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r")):
            message = message.replace(a, b)
        record = f"{nonce}\t{os.getpid()}\tsetup-error\t{message[:3000]}\n".encode("utf-8", "replace")
        try:
            os.write(results_fd, record)
        finally:
            os._exit(70)

    try:
        interpreter = _build(payload, data)
    except Exception as exc:  # noqa: BLE001 - any failure to isolate refuses the run
        fail(f"{type(exc).__name__}: {exc}")
        return
    flags = ["-s", "-S", "-B"] + (["-P"] if sys.version_info >= (3, 11) else [])
    try:
        os.execv(interpreter, [interpreter, *flags, "-c", harness_source])
    except OSError as exc:
        fail(f"exec of the harness: {exc}")


def _build(payload, data):
    """Everything before the exec; returns the interpreter path to exec. Raises on any failure."""
    import ctypes
    import os
    import resource
    import sys

    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret, what):
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    limits = payload["limits"]
    uid, gid = payload["uid"], payload["gid"]
    mode = payload["network"]
    real_uid = os.getuid()
    if os.getpid() != 2:  # bwrap's reaper is pid 1 of the run's own pid namespace, this is pid 2
        raise OSError(f"pid {os.getpid()}, not 2: this is not a fresh bubblewrap pid namespace")

    # -- 1. the payload, for the harness: an anonymous file as its stdin. Made before the
    # seccomp filter, which refuses memfd_create.
    carrier = os.memfd_create("teamrl-payload", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(carrier, view) :]
    os.lseek(carrier, 0, os.SEEK_SET)
    os.dup2(carrier, 0)
    os.close(carrier)

    # -- 2. mounts, in a mount namespace of this process's own (in a user namespace, bwrap's is
    # owned by its outer user namespace, where this process holds no capability)
    CLONE_NEWNS = 0x00020000
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
        1,
        2,
        4,
        8,
        32,
        4096,
        16384,
        1 << 18,
    )
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")

    def bind_read_only(source, target, extra):
        check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), f"bind {source} on {target}")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | extra
        check(libc.mount(None, target.encode(), None, flags, None), f"remount {target} read-only")

    # The execute-only interpreter, staged in bwrap's /tmp (covered below by the run's own).
    interpreter = os.path.realpath(sys.executable)
    staged = "/tmp/.teamrl-interpreter"
    src = os.open(interpreter, os.O_RDONLY)
    dst = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o111)
    try:
        while True:
            chunk = os.read(src, 1 << 20)
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(dst, view) :]
    finally:
        os.close(src)
        os.close(dst)
    if os.stat(staged).st_mode & 0o7777 != 0o111:
        raise OSError(f"the interpreter's copy is not execute-only ({oct(os.stat(staged).st_mode)})")
    bind_read_only(staged, interpreter, 0)

    # Native-call and subinterpreter modules of this interpreter: /dev/null in their place.
    places = set()
    for entry in sys.path:
        if entry.endswith("/lib-dynload"):
            stdlib = os.path.dirname(entry)
            places.update({entry, stdlib + "/site-packages", stdlib + "/dist-packages"})
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    places.update({"/usr/lib/python3/dist-packages", f"/usr/local/lib/{version}/dist-packages"})
    for place in sorted(places):
        try:
            names = os.listdir(place)
        except OSError:
            continue
        for name in names:
            if name.partition(".")[0] in NATIVE_MODULES and name.endswith(".so"):
                bind_read_only("/dev/null", f"{place}/{name}", MS_NOEXEC)

    # The run's writable places: size and files bounded, nothing on them executable.
    disk = limits["max_disk_bytes"]
    tmp_bytes = disk * 3 // 4
    for place, size in (("/tmp", tmp_bytes), ("/dev/shm", disk - tmp_bytes)):
        options = f"mode=1777,size={size},nr_inodes={max(16, size // INODE_BYTES)}"
        check(
            libc.mount(b"tmpfs", place.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options.encode()),
            f"mount the run's tmpfs on {place}",
        )
    os.chdir("/tmp")

    # -- 3. limits (lowering hard limits is permanent for the unprivileged program)
    cpu = int(-(-limits["cpu_seconds"] // 1))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"], limits["max_file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nofile = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    nproc = limits["max_processes"]
    if uid is None:
        # RLIMIT_NPROC counts every task of the user, so leave room for the caller's own.
        nproc += _count_tasks(real_uid)
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        if hard != resource.RLIM_INFINITY:
            nproc = min(nproc, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    # -- the privilege drop: root ignores RLIMIT_NPROC and may signal anyone
    PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 38, 22, 47, 4
    if uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # all ids non-zero: the kernel clears every capability
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
            raise OSError("could not drop privileges")
    else:
        check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
        _drop_capabilities(libc)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # Credentials changed above, which clears the parent-death signal: set it afterwards
    # (the parent is bwrap's pid 1; when it dies the kernel kills the whole pid namespace).
    check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != 1:
        os._exit(72)

    # -- 4. the seccomp filter (last: it refuses memfd_create, which step 1 used)
    filter_ = seccomp_filter(os.uname().machine, mode == "seccomp")
    if filter_ is None:
        if mode == "seccomp":
            raise OSError(f"no seccomp filter for {os.uname().machine}")
    else:
        _install_seccomp(libc, check, PR_SET_SECCOMP, filter_)
    return interpreter


def seccomp_filter(machine, refuse_sockets):
    """The BPF program (bytes): memfd_create and shmget kill the process (their memory is
    outside RLIMIT_AS and the run's tmpfs), io_uring_setup and every other ABI's system calls
    fail with EACCES, and with ``refuse_sockets`` so does socket() for any family but AF_UNIX.
    None for a machine without a table here."""
    import errno
    import struct

    table = {  # arch, socket, shmget, memfd_create, io_uring_setup
        "x86_64": (0xC000003E, 41, 29, 319, 425),
        "aarch64": (0xC00000B7, 198, 194, 279, 425),
    }
    if machine not in table:
        return None
    arch, nr_socket, nr_shmget, nr_memfd, nr_io_uring = table[machine]
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
    ALLOW, ERRNO, KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
    deny = ERRNO | errno.EACCES
    program = [
        (LD, 0, 0, 4),  # seccomp_data.arch
        (JEQ, 1, 0, arch),
        (RET, 0, 0, deny),  # another ABI (i386, x32 tricks): refuse everything
        (LD, 0, 0, 0),  # seccomp_data.nr
        (JGE, 0, 1, 0x40000000),  # x32 syscall numbers
        (RET, 0, 0, deny),
        (JEQ, 0, 1, nr_io_uring),
        (RET, 0, 0, deny),
        (JEQ, 0, 1, nr_memfd),
        (RET, 0, 0, KILL_PROCESS),
        (JEQ, 0, 1, nr_shmget),
        (RET, 0, 0, KILL_PROCESS),
    ]
    if refuse_sockets:
        program += [
            (JEQ, 1, 0, nr_socket),
            (RET, 0, 0, ALLOW),
            (LD, 0, 0, 16),  # args[0], the address family (low 32 bits)
            (JEQ, 0, 1, 1),  # AF_UNIX
            (RET, 0, 0, ALLOW),
            (RET, 0, 0, deny),
        ]
    else:
        program.append((RET, 0, 0, ALLOW))
    return b"".join(struct.pack("=HBBI", *ins) for ins in program)


def _install_seccomp(libc, check, PR_SET_SECCOMP, raw):
    import ctypes

    buf = ctypes.create_string_buffer(raw, len(raw))

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Prog(len(raw) // 8, ctypes.cast(buf, ctypes.c_void_p))
    check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(prog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _drop_capabilities(libc):
    """Clear every capability (effective, permitted, inheritable) this process holds."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)
    data = (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _count_tasks(uid):
    """Threads of all processes whose real uid is ``uid`` (for RLIMIT_NPROC headroom)."""
    import os

    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields.get("Threads", "1"))
        except (OSError, ValueError, KeyError):
            continue
    return total


if __name__ == "__main__":
    _setup()

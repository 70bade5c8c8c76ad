"""The program that runs inside every sandbox process. teamrl never imports this module.

``sandbox.run_program`` starts bubblewrap in a new session and writes one marshal-encoded
payload to its stdin; the first stage (``_setup.py``) builds the isolation with the privileges
bubblewrap left it (mounts, limits, the unprivileged user, seccomp), then execs
``python -s -S -B -c <this file's text>`` from an execute-only copy of the interpreter. This
code then, in order:

1. reads the payload (marshal; program, tests, a random nonce, the results fd, limits, uid/gid);
2. checks the isolation (namespaces other than the caller's; no writable mount but the run's
   own noexec, size- and file-limited tmpfs; no capability, no_new_privs, the seccomp filter,
   the run's uid, not dumpable; a difference stops the run; this process never loads
   ctypes), and installs the audit hook;
3. runs setup and program in a fresh ``__main__`` namespace, then each test in a copy of that
   namespace whose builtins are a snapshot taken before the program ran; a test the caller
   split into a call is only called, and its value sent back as plain data (the caller,
   which alone knows the expected value, decides);
4. reports through the results fd, one line per event, each prefixed by the nonce and this
   process's pid. The nonce only ever travels through stdin, so a program that prints, exits
   early, forks or scribbles on file descriptors cannot produce a valid line: missing or
   malformed lines count against it, never for it.

Everything the harness needs after the program starts is captured beforehand as a local, so
patching ``builtins`` or stdlib modules does not change what the harness does; module
attributes the program rebinds are put back before the tests, and a test during which one
changes does not pass. An audit hook (irremovable) refuses tracing, gc introspection, other
threads' frames, subinterpreters, and native code: ctypes, cffi and the test modules under any
dotted name, and extension modules from anywhere but the interpreter's own lib-dynload (the
file ``_imp.create_dynamic`` opens is checked, whatever loader or spec led there). Finally,
running as the run's own uid, the harness kills every other process of that uid with kill(-1),
and reports whether /tmp or /dev/shm ended full (the run hit its disk limit).

The isolation check (``_isolate``, ``_check_mounts``) and the audit hook (``NATIVE_MODULES``,
``_make_audit_hook``) are in ``_harness_guards.py``: ``jail.py`` sends that file's text before this
one's, as one program, so they are globals here.

Known gap: a program written against these internals can walk its own stack
(``sys._getframe(1).f_locals``; frame attributes are not audited) to the harness's reporting
function. That gains nothing: a split test's verdict is the caller's, and a test of any other
shape is only *served* here (``serve``: the judge's process, a separate sandbox run that never
holds the program, runs it and relays each call of the program's functions; the value goes back
as plain data), and its source never comes here: the payload says only ``serve``, so no frame,
object or file of this process holds a whole test's expected values. The harness runs tests as
snippets only in the judge's process, where the "program" is ``_judge_runtime.py``.
"""


def _harness():  # everything lives in this frame, not in module globals
    import builtins
    import marshal
    import os
    import resource
    import sys
    import types

    import math  # noqa: F401 - loaded before the module snapshot below: tests use it
    from _sha256 import sha256 as _sha256  # digests of large outputs of a reference test

    # marshal, not json: it is built in, and importing json (re, enum...) costs ~8 ms a run.
    payload = marshal.loads(sys.stdin.buffer.read())
    # The program gets an empty stdin; the payload (and the nonce in it) is gone from fd 0.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    nonce = payload["nonce"]
    results_fd = payload["results_fd"]
    os.set_inheritable(results_fd, False)  # exec'd children of the program never get it
    # Tests the judge's process runs whole: their calls come in here, plain values go out.
    serve_fds = payload.get("serve_fds")
    for fd in serve_fds or ():
        os.set_inheritable(fd, False)

    # Captured now: the program may patch builtins and modules, never these locals.
    _write = os.write
    _exit = os._exit
    _kill = os.kill
    _getuid = os.getuid
    _getpid = os.getpid
    _statvfs = os.statvfs
    _str = str
    _type = type
    _len = len
    _replace = str.replace
    _join = str.join
    _encode = str.encode
    _decode = bytes.decode
    _splitlines = str.splitlines
    _strip = str.strip
    _type_name = type.__dict__["__name__"].__get__
    _tb_of = BaseException.__dict__["__traceback__"].__get__
    _exec = exec
    _BaseException = BaseException
    _MemoryError = MemoryError
    _AssertionError = AssertionError
    _SyntaxError = SyntaxError
    _bytearray = bytearray
    _OSError = OSError
    _isinstance = isinstance
    _dict = dict
    _dict_get = dict.get
    _read = os.read
    _loads = marshal.loads
    _mro_of = type.__dict__["__mro__"].__get__

    def emit(*fields):
        """Write one record: nonce, pid, fields; tab-separated, escaped, one atomic write."""
        parts = [nonce, _str(_getpid())]
        for value in fields:
            text = _join("", [_str(value)])  # an exact str, whatever str() returned
            text = _replace(text, "\\", "\\\\")
            text = _replace(text, "\t", "\\t")
            text = _replace(text, "\n", "\\n")
            text = _replace(text, "\r", "\\r")
            parts.append(text)
        data = _encode(_join("\t", parts), "utf-8", "replace")
        if _len(data) > 3800:  # stay below PIPE_BUF so concurrent writers cannot interleave
            data = _encode(_decode(data[:3800], "utf-8", "ignore"), "utf-8")
        try:
            _write(results_fd, data + b"\n")
        except _OSError:
            _exit(71)

    def fail_setup(message):
        emit("setup-error", message)
        _exit(70)

    _tuple = tuple
    _list = list
    _TypeError, _ValueError, _RecursionError, _NameError = TypeError, ValueError, RecursionError, NameError
    _int, _float, _complex, _bool, _bytes, _set, _frozenset = int, float, complex, bool, bytes, set, frozenset
    _float_hex = float.hex
    _issubclass = issubclass
    _int_hex = int.__format__
    _int_int, _float_float, _complex_complex, _str_str = int.__int__, float.__float__, complex.__complex__, str.__str__
    _bytes_join = bytes.join
    _truth = bool
    _ascii = ascii
    _append = list.append
    _dict_items = dict.items
    _hex = bytes.hex

    def as_json(tree):
        """JSON text of a [tag, payload] tree: its only strings are tags and hex digits, so
        ascii() with double quotes is JSON (which the caller parses fast, whatever it is sent)."""
        return _replace(_ascii(tree), "'", '"')

    def encode_plain(value, limit=200_000, canonical=False):
        """JSON of a [tag, payload] tree (str and bytes as hex), or '!' and why the value is not
        plain data. Exact types only: no method of the program's classes (or subclasses) ever runs."""
        budget = [limit]

        def walk(v, depth):
            t = _type(v)
            budget[0] -= 1
            if depth > 100 or budget[0] < 0:
                raise _ValueError("a value too large or nested too deeply")
            # A subclass of a plain type (collections.Counter, an int subclass) is sent as its
            # plain content, read through the base type's own slots: no method it overrides
            # (__eq__, __iter__, __int__...) ever runs, and the caller compares the content.
            if v is None:
                return ["n"]
            if t is _bool:
                return ["b", 1 if v else 0]
            if _issubclass(t, _int):
                v = _int_int(v)  # beyond 4300 digits ascii() refuses an int: hex has no limit
                return ["i", v] if -(10**18) < v < 10**18 else ["h", _int_hex(v, "x")]
            if _issubclass(t, _float):
                return ["f", _float_hex(_float_float(v))]
            if _issubclass(t, _complex):
                c = _complex_complex(v)
                return ["c", [_float_hex(c.real), _float_hex(c.imag)]]
            if _issubclass(t, _str):
                return ["s", _hex(_encode(_str_str(v), "utf-8", "surrogatepass"))]
            if _issubclass(t, _bytes):
                return ["y", _hex(_bytes_join(b"", [v]))]
            for base, tag in ((_list, "l"), (_tuple, "t"), (_set, "S"), (_frozenset, "F")):
                if _issubclass(t, base):
                    items = []
                    for x in base.__iter__(v):
                        _append(items, walk(x, depth + 1))
                    if canonical and tag in ("S", "F"):  # equal sets, one encoding (and digest)
                        items.sort(key=_ascii)
                    return [tag, items]
            if _issubclass(t, _dict):
                items = []
                for k, x in _dict_items(v):
                    _append(items, [walk(k, depth + 1), walk(x, depth + 1)])
                if canonical:
                    items.sort(key=_ascii)
                return ["d", items]
            raise _TypeError(
                f"a {_type_name(t)}, not plain data "
                "(None, bool, int, float, complex, str, bytes, list, tuple, dict, set)"
            )

        try:
            return as_json(walk(value, 0))
        except (_TypeError, _ValueError, _RecursionError) as exc:
            return "!" + _join("", [_str(exc)])

    try:
        isolation = _isolate(payload)  # noqa: F821 - a global from _harness_guards.py (sent before this file)
    except Exception as exc:  # noqa: BLE001 - any failure to isolate stops the run here
        fail_setup(f"{type(exc).__name__}: {exc}")
        return

    # ---- the program's namespace -------------------------------------------------------
    main_module = types.ModuleType("__main__")
    namespace = main_module.__dict__
    namespace["__builtins__"] = builtins
    sys.modules["__main__"] = main_module
    sys.argv = [""]
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]
    pristine_builtins = dict(builtins.__dict__)

    setup_src = payload["setup"]
    code_src = payload["code"]
    test_srcs = payload["tests"]
    limits = payload["limits"]

    def compile_or_error(source, filename):
        try:
            return compile(source, filename, "exec", dont_inherit=True), None
        except _BaseException as exc:  # SyntaxError, ValueError (NUL bytes), RecursionError...
            return None, exc

    setup_code, setup_exc = compile_or_error(setup_src, "<setup>") if setup_src else (None, None)
    program_code, program_exc = compile_or_error(code_src, "<solution>")
    # A test is a snippet (str) to run here, or a call (name, args, kwargs, source, wants)
    # whose value goes back as plain data: its verdict is taken by the caller, who kept the
    # expected value. wants "each": args is a list of argument lists, the value the list of
    # outputs (a HumanEval+ chunk, compared by the caller with a reference run's).
    compiled_tests = [
        compile_or_error(t, f"<test {i}>") if _isinstance(t, str) else (t, None) for i, t in enumerate(test_srcs)
    ]
    sources = {"<setup>": setup_src, "<solution>": code_src}
    for i, t in enumerate(test_srcs):
        sources[f"<test {i}>"] = t if _isinstance(t, str) else t[3]  # (name, args, kwargs, source, wants)

    def describe(exc, where, filename):
        """'where, line N: source -> ExcType: message', never running program code unguarded."""
        try:
            name = _type_name(_type(exc))
        except _BaseException:
            name = "exception"
        try:
            message = _join("", [_str(exc)])
        except _BaseException:
            message = "<unprintable>"
        line_no = None
        try:
            if _isinstance(exc, _SyntaxError) and exc.filename == filename:
                line_no = exc.lineno
            tb = _tb_of(exc)
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == filename:
                    line_no = tb.tb_lineno
                tb = tb.tb_next
            tb = None
        except _BaseException:
            pass
        text = where
        if line_no is not None:
            lines = _splitlines(sources.get(filename, ""))
            if 0 < line_no <= _len(lines):
                text = f"{where}, line {line_no}: {_strip(lines[line_no - 1])}"
            else:
                text = f"{where}, line {line_no}"
        text = f"{text} -> {name}"
        if message:
            text = f"{text}: {message}"
        if _len(text) > 1000:
            text = text[:1000] + "..."
        return text

    def kind_of(exc):
        if _isinstance(exc, _MemoryError):
            return "memory"
        if _isinstance(exc, _AssertionError):
            return "fail"
        return "error"

    # ---- last preparations, then the program -------------------------------------------
    stdout_flush = sys.stdout.flush
    stderr_flush = sys.stderr.flush
    # Extension modules load only from the interpreter's own lib-dynload (read-only).
    extension_dirs = [p for p in sys.path if p.endswith("/lib-dynload")]
    sys.addaudithook(_make_audit_hook(isolation["network"] == "audit-hook", extension_dirs))  # noqa: F821 - as above
    mem = limits["memory_mb"] * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    reserve = [_bytearray(4 << 20)]  # freed on MemoryError so that reporting still works

    def release_reserve():
        reserve.clear()

    # Module attributes as they are before the program: restored before the tests, and a
    # test during which the program rebinds one (math.isclose = lambda *a: True) fails.
    modules = sys.modules
    watched = []
    missing = object()

    def snapshot_modules():
        for name, module in list(modules.items()):
            if name in ("__main__", "builtins", "sys") or module is None:
                continue
            watched.append((name, module, module.__dict__, list(module.__dict__.items())))

    def restore_modules():
        changed = None
        for name, module, module_dict, items in watched:
            if _dict_get(modules, name, missing) is not module:
                modules[name] = module
                changed = changed or name
            for key, value in items:
                if _dict_get(module_dict, key, missing) is not value:
                    module_dict[key] = value
                    changed = changed or f"{name}.{key}"
        return changed

    sandbox_uid = isolation["uid"]
    emit("hello", isolation["network"], isolation["filesystem"], isolation["uid"])

    body_ok = True
    try:
        if setup_exc is not None:
            raise setup_exc
        if setup_code is not None:
            _exec(setup_code, namespace)
        snapshot_modules()  # after setup (its imports are the tests' too), before the program
        if program_exc is not None:
            raise program_exc
        _exec(program_code, namespace)
    except _BaseException as exc:  # SystemExit and KeyboardInterrupt included: not a pass
        body_ok = False
        kind = kind_of(exc)
        if kind == "memory":
            release_reserve()
        filename = "<setup>" if setup_code is None and setup_exc is not None else "<solution>"
        if setup_exc is None and setup_code is not None and _tb_of(exc) is not None:
            tb = _tb_of(exc)
            while tb is not None:  # the innermost of setup/solution decides the label
                fname = tb.tb_frame.f_code.co_filename
                if fname in ("<setup>", "<solution>"):
                    filename = fname
                tb = tb.tb_next
            tb = None
        where = "setup" if filename == "<setup>" else "program"
        emit("body", "memory" if kind == "memory" else "error", describe(exc, where, filename))
        exc = None
    if body_ok:
        emit("body", "ok")
        restore_modules()
        test_namespace = _dict(namespace)
        test_namespace["__builtins__"] = _dict(pristine_builtins)
        serving = [serve_fds is not None]

        def read_exact(size):
            chunks, got = [], 0
            while got < size:
                try:
                    chunk = _read(serve_fds[0], size - got)
                except _OSError:
                    chunk = b""
                if not chunk:
                    return None
                _append(chunks, chunk)
                got += _len(chunk)
            return _bytes_join(b"", chunks)

        def receive():
            """The caller's next message (marshal, length-prefixed): ("call", name, args,
            kwargs) or ("end",); None when the relay is over or unreadable."""
            head = read_exact(8)
            try:
                body = read_exact(_int(_decode(head, "ascii"), 16)) if head is not None else None
                message = _loads(body) if body is not None else None
            except _BaseException:
                return None
            if _type(message) is not _tuple or not message or (message[0] == "call" and _len(message) != 4):
                return None
            return message

        def send(text):
            data = _encode(text, "utf-8", "replace")
            data = _encode("%08x" % _len(data), "ascii") + data
            while data:
                try:
                    data = data[_write(serve_fds[1], data):]
                except _OSError:
                    serving.clear()
                    return

        def builtin_name(exc):
            """The nearest built-in exception type of ``exc`` (the judge raises that one)."""
            try:
                for klass in _mro_of(_type(exc)):
                    name = _type_name(klass)
                    if _dict_get(pristine_builtins, name, missing) is klass:
                        return name
            except _BaseException:
                pass
            return "Exception"

        def serve():
            """Answer the calls of a test the judge's process runs, until the caller says it
            has ended. Each reply is the value as plain data ('v', plus list/dict/set
            arguments as they are after the call) or the exception raised ('x')."""
            while serving:
                message = receive()
                if message is None:
                    serving.clear()
                    return
                if message[0] != "call":
                    return
                _, name, args, kwargs = message
                try:
                    function = _dict_get(test_namespace, name, missing)
                    if function is missing:
                        function = _dict_get(pristine_builtins, name, missing)
                    if function is missing:
                        raise _NameError(f"name {name!r} is not defined")
                    result = function(*args, **kwargs)
                    reply = "v" + encode_plain(result) + "\t"
                    result = None
                    for arg in args:
                        if _type(arg) is _list or _type(arg) is _dict or _type(arg) is _set:
                            reply = reply + encode_plain(args)
                            break
                except _BaseException as exc:
                    if kind_of(exc) == "memory":
                        release_reserve()
                    try:
                        text = _join("", [_str(exc)])
                    except _BaseException:
                        text = "<unprintable>"
                    reply = "x" + builtin_name(exc) + "\t" + text[:2000]
                    exc = None
                send(reply)
        index = 0
        count = _len(compiled_tests)
        while index < count:
            test_code, test_exc = compiled_tests[index]
            if _type(test_code) is _tuple and test_code[4] == "serve":
                serve()  # the judge's process runs this test and decides it
                restore_modules()
                emit("test", index, "served")
                index += 1
                continue
            filename = f"<test {index}>"
            value = None
            try:
                if test_exc is not None:
                    raise test_exc
                if _type(test_code) is _tuple:
                    name, args, kwargs, _, wants = test_code
                    function = _dict_get(test_namespace, name, missing)
                    if function is missing:
                        function = _dict_get(pristine_builtins, name, missing)
                    if function is missing:
                        raise _NameError(f"name {name!r} is not defined")
                    if wants == "each":  # a reference test: the outputs on each input, in order
                        parts = []
                        for each in args:
                            part = encode_plain(function(*each), 5_000_000, True)
                            if part[:1] == "!":
                                parts = None
                                value = part
                                break
                            if _len(part) > 4_000:  # compared by digest (the reference's too)
                                part = as_json(["#", _sha256(_encode(part, "ascii")).hexdigest()])
                            _append(parts, part)
                        if parts is not None:
                            value = _join("", ['["l", [', _join(", ", parts), "]]"])
                    else:
                        result = function(*args, **kwargs)
                        # "truth": only its truth value matters (a bare ``assert f(x)``)
                        value = encode_plain(_truth(result) if wants == "truth" else result)
                    result = None
                else:
                    _exec(test_code, test_namespace)
            except _BaseException as exc:
                kind = kind_of(exc)
                if kind == "memory":
                    release_reserve()
                emit("test", index, kind, describe(exc, f"test {index + 1}", filename))
                exc = None
                restore_modules()
            else:
                changed = restore_modules()
                if changed is None and value is not None:
                    chunks = [value[k : k + 1500] for k in range(0, _len(value), 1500)] or [""]
                    for k, chunk in enumerate(chunks):
                        emit("value", index, k, _len(chunks), chunk)
                elif changed is None:
                    emit("test", index, "pass")
                else:
                    emit(
                        "test", index, "error", f"test {index + 1}: the program changed the module attribute {changed}"
                    )
            index += 1
    try:
        stdout_flush()
    except _BaseException:
        pass
    try:
        stderr_flush()
    except _BaseException:
        pass
    # As the run's own uid, kill(-1) reaches every process the program started (daemons
    # included) in one atomic sweep that a forking or pid-hopping process cannot outrun.
    # Never without a dropped, per-run uid: it would hit the caller's processes.
    swept = sandbox_uid is not None and _getuid() == sandbox_uid
    if swept:
        try:
            _kill(-1, 9)
        except _BaseException:
            pass
    # A run whose /tmp or /dev/shm is full (every byte or every file it may have) hit its disk
    # limit: the caller reports "disk" rather than the failures that followed.
    for place in ("/tmp", "/dev/shm"):
        try:
            st = _statvfs(place)
            if st.f_ffree == 0 or st.f_bfree == 0:
                emit("disk", place, st.f_files - st.f_ffree, (st.f_blocks - st.f_bfree) * st.f_frsize)
                break
        except _BaseException:
            pass
    if swept:
        emit("done", "swept")
    else:
        emit("done")
    _exit(0)  # no atexit handlers, no waiting for the program's threads


_harness()

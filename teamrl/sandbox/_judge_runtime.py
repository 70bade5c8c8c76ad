"""Runs inside the *judge's* sandbox process, as that run's program. teamrl never imports it.

The judge is a second, separate sandbox run (``relay.JudgeRun``) that runs the tests
``judge.split_test`` cannot split, whole, with its own harness, nonce and result channel. The
program under test never enters it: :func:`_teamrl_judge_runtime` binds each name a test takes
from the program (``judge.program_names``) to a :class:`Proxy`. Calling a proxy sends the
call's arguments, as plain data, to the caller, which relays them to the program's own sandbox
process; that process calls its function and sends the value back as plain data (its content
only: no method of the program's classes runs here), and the assert runs here. What the
program returns can therefore only be judged by its plain value.

Messages are length-prefixed (8 hex digits): requests out are JSON of a [tag, payload] tree,
as the harness encodes values (the caller parses them without trusting them); replies
in are ``marshal`` blobs written by the caller alone.
"""


def _teamrl_judge_runtime(request_fd, reply_fd, names):  # everything in this frame
    import builtins
    import marshal
    import os
    import sys

    _write, _read, _loads = os.write, os.read, marshal.loads
    _type, _len, _ascii, _isinstance = type, len, ascii, isinstance
    _float_hex = float.hex
    _stdlib = frozenset(getattr(sys, "stdlib_module_names", ()))
    pristine = dict(vars(builtins))
    exception_types = {n: v for n, v in pristine.items() if _isinstance(v, type) and issubclass(v, BaseException)}

    class Unjudgeable(BaseException):
        """The test needs more of the program than calls with plain data: it cannot be judged
        outside the program's process, so it does not pass (a BaseException: a test's
        ``except Exception`` does not swallow it)."""

    class NotPlainData(AssertionError):
        """The program returned something other than plain data: a wrong answer, as for a
        split test."""

    def encode(value, depth=0):
        t = _type(value)
        if depth > 100:
            raise Unjudgeable("cannot be judged outside the program's process: an argument nested too deeply")
        if value is None:
            return ["n"]
        if t is bool:
            return ["b", 1 if value else 0]
        if t is int:
            return ["i", value] if -(10**18) < value < 10**18 else ["h", format(value, "x")]
        if t is float:
            return ["f", _float_hex(value)]
        if t is complex:
            return ["c", [_float_hex(value.real), _float_hex(value.imag)]]
        if t is str:
            return ["s", value.encode("utf-8", "surrogatepass").hex()]
        if t is bytes:
            return ["y", value.hex()]
        tags = {list: "l", tuple: "t", set: "S", frozenset: "F"}
        if t in tags:
            return [tags[t], [encode(x, depth + 1) for x in value]]
        if t is dict:
            return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
        if t is Proxy:
            what = f"the program's {object.__getattribute__(value, '_teamrl_name')} passed as an argument"
        else:
            what = f"an argument of type {t.__name__}, not plain data"
        raise Unjudgeable(f"cannot be judged outside the program's process: {what}")

    def exchange(request):
        data = _ascii(request).replace("'", '"').encode("ascii")  # JSON: its strings are tags and hex
        data = b"%08x" % _len(data) + data
        while data:
            data = data[_write(request_fd, data):]
        head = b""
        while _len(head) < 8:
            chunk = _read(reply_fd, 8 - _len(head))
            if not chunk:
                raise Unjudgeable("cannot be judged outside the program's process: the caller stopped relaying calls")
            head += chunk
        size, body = int(head, 16), []
        got = 0
        while got < size:
            chunk = _read(reply_fd, min(size - got, 1 << 20))
            if not chunk:
                raise Unjudgeable("cannot be judged outside the program's process: the caller stopped relaying calls")
            body.append(chunk)
            got += _len(chunk)
        return _loads(b"".join(body))

    def call(name, args, kwargs):
        encoded = ["t", [encode("call"), encode(name), encode(args), encode(kwargs)]]
        reply = exchange(encoded)
        kind = reply[0]
        if kind == "v":
            value, after = reply[1], reply[2]
            if after is not None:  # the program changed a list, dict or set argument in place
                for arg, new in zip(args, after):
                    if _type(arg) is list and _type(new) is list:
                        arg[:] = new
                    elif (_type(arg) is dict and _type(new) is dict) or (_type(arg) is set and _type(new) is set):
                        arg.clear()
                        arg.update(new)
            return value
        if kind == "x":  # the program's call raised: the nearest built-in exception type, here
            exc_type = exception_types.get(reply[1], Exception)
            try:
                exc = exc_type(reply[2])
            except Exception:  # noqa: BLE001 - a type with a stricter constructor
                exc = Exception(f"{reply[1]}: {reply[2]}")
            raise exc
        if kind == "n":
            raise NotPlainData(reply[1])
        raise Unjudgeable(f"cannot be judged outside the program's process: {reply[1]}")

    def unjudgeable(proxy, what):
        name = object.__getattribute__(proxy, "_teamrl_name")
        return Unjudgeable(f"cannot be judged outside the program's process: the test uses the program's {name} {what}")

    class Proxy:
        """The program's object called ``name``, in the judge: it can only be called."""

        __slots__ = ("_teamrl_name",)

        def __init__(self, name):
            object.__setattr__(self, "_teamrl_name", name)

        def __call__(self, *args, **kwargs):
            return call(object.__getattribute__(self, "_teamrl_name"), args, kwargs)

        def __getattr__(self, attribute):
            name = object.__getattribute__(self, "_teamrl_name")
            if name in _stdlib:  # a module the program imported and the test relies on: ours
                return getattr(__import__(name), attribute)
            raise unjudgeable(self, f"other than by calling it (.{attribute})")

        def __repr__(self):
            return f"<the program's {object.__getattribute__(self, '_teamrl_name')}>"

        def _refuse(self, *args):
            raise unjudgeable(self, "other than by calling it")

        __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __iter__ = __len__ = _refuse
        __getitem__ = __contains__ = __int__ = __float__ = __index__ = __hash__ = _refuse

    return {name: Proxy(name) for name in names}

"""What the harness reports on its result channel: the nonce-authenticated records, parsed."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Inside the run's own pid namespace bwrap's reaper is pid 1 and the harness pid 2; records
# from any other pid (a forked copy of the harness) are not authoritative.
HARNESS_PID = 2

_UNESCAPE = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r"}


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m.group(1), m.group(1)), text)


@dataclass
class Records:
    hello: list[str] | None = None
    setup_error: str | None = None
    body: list[str] | None = None
    tests: dict[int, list[str]] | None = None
    values: dict[int, dict[int, str]] | None = None  # test -> chunk index -> text (split tests)
    value_chunks: dict[int, int] | None = None  # test -> number of chunks announced
    done: bool = False
    tampered: str | None = None
    unjudgeable: set[int] = field(default_factory=set)  # tests the judge could not decide
    disk: list[str] | None = None  # /tmp or /dev/shm was full at the end: place, files, bytes
    late: str | None = None  # the wall-clock limit passed while the caller read the values


def parse_records(data: bytes, nonce: str, n_tests: int) -> Records:
    rec = Records(tests={}, values={}, value_chunks={})
    lines = data.split(b"\n")
    if lines and lines[-1]:
        rec.tampered = "an unterminated line on the result channel"
    for raw in lines[:-1]:
        parts = raw.decode("utf-8", "replace").split("\t")
        if len(parts) < 3 or parts[0] != nonce:
            rec.tampered = "a line without the harness's nonce on the result channel"
            continue
        if parts[1] != str(HARNESS_PID):
            continue  # a forked copy of the harness (the program forked): not authoritative
        kind, fields = parts[2], [_unescape(p) for p in parts[3:]]
        if kind == "hello":
            rec.hello = fields
        elif kind == "setup-error":
            rec.setup_error = fields[0] if fields else "unknown"
        elif kind == "body":
            rec.body = fields
        elif kind == "test" and fields and fields[0].isdigit() and int(fields[0]) < n_tests:
            rec.tests[int(fields[0])] = fields[1:]
        elif kind == "value" and len(fields) == 4 and all(f.isdigit() for f in fields[:3]) and int(fields[0]) < n_tests:
            index, chunk, count = int(fields[0]), int(fields[1]), int(fields[2])
            chunks = rec.values.setdefault(index, {})
            if chunk in chunks or rec.value_chunks.setdefault(index, count) != count:
                rec.tests[index] = ["error", f"test {index + 1}: its value was reported twice"]
            chunks[chunk] = fields[3]
        elif kind == "disk":
            rec.disk = fields
        elif kind == "done":
            rec.done = True
    return rec

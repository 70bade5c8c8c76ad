"""Reading the JSONL files that data sets come in (plain or gzipped), with errors that name the file and line."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from teamrl.core.config import InputError, InputFileMissing


def read_jsonl_lines(path: str | Path, what: str, hint: str = "") -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a JSONL file (``.gz`` read transparently).

    A missing file raises :class:`InputFileMissing` (a ``FileNotFoundError``) naming ``what`` and the path (plus
    ``hint``); a
    line that is not a JSON object raises :class:`InputError` (a ``ValueError``) naming the file and line.
    """
    p = Path(path).expanduser()
    if not str(path) or not p.is_file():
        raise InputFileMissing(f"{what}: {str(p)!r} is not a file" + (f"; {hint}" if hint else ""))
    opener = gzip.open if p.name.endswith(".gz") else open
    rows = []
    with opener(p, "rt", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{p}: line {n} is not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise InputError(f"{p}: line {n} is not a JSON object (got {type(row).__name__}); each line must "
                                     "be one {...} record")
                rows.append((n, row))
    return rows


def read_jsonl(path: str | Path, what: str, hint: str = "") -> list[dict[str, Any]]:
    """The objects of a JSONL file, blank lines skipped; errors as :func:`read_jsonl_lines`."""
    return [row for _, row in read_jsonl_lines(path, what, hint)]

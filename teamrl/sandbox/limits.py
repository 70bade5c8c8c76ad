"""Resource limits for one sandboxed execution."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["SandboxLimits"]

# Below this the interpreter itself cannot run a program (its own mappings take ~30 MB).
_MIN_MEMORY_MB = 64


@dataclass(frozen=True)
class SandboxLimits:
    """Limits applied to one run of an untrusted program.

    wall_seconds:     wall-clock time for the whole run (start-up, program and tests).
    cpu_seconds:      CPU time of the program's process (RLIMIT_CPU, whole seconds, rounded up).
    memory_mb:        address space of each process (RLIMIT_AS), in MiB. Memory no rlimit counts is
                      refused: a process calling memfd_create or shmget is killed (status "memory").
    max_processes:    processes and threads the sandbox user may have at once (RLIMIT_NPROC).
    max_output_bytes: bytes of stdout and of stderr kept (the rest is dropped and
                      output_truncated set); a run whose output passes max(16 x this, 1 MiB)
                      is stopped (status "killed").
    max_file_bytes:   largest file the program may write (RLIMIT_FSIZE).
    max_disk_bytes:   everything the run may write, all files together: its /tmp gets 3/4 of
                      it and /dev/shm 1/4 (size-limited tmpfs, in memory, noexec, gone with the
                      run), and each file or directory costs a 4 KiB share of it (nr_inodes), so
                      the run may make at most max_disk_bytes / 4096 of them. A run that fails a
                      test with either full ends with status "disk".
    """

    wall_seconds: float = 10.0
    cpu_seconds: float = 10.0
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 64_000
    max_file_bytes: int = 10_000_000
    max_disk_bytes: int = 64_000_000

    def __post_init__(self) -> None:
        minimum = {
            "wall_seconds": 0.0,
            "cpu_seconds": 0.0,
            "memory_mb": _MIN_MEMORY_MB,
            "max_processes": 1,
            "max_output_bytes": 0,
            "max_file_bytes": 0,
            "max_disk_bytes": 1 << 16,
        }
        for f in fields(self):
            value = getattr(self, f.name)
            is_float_field = f.type in ("float", float)
            allowed = (int, float) if is_float_field else (int,)
            if isinstance(value, bool) or not isinstance(value, allowed):
                kind = "a number" if is_float_field else "an integer"
                raise ValueError(f"SandboxLimits.{f.name}: {value!r} is not {kind}")
            low = minimum[f.name]
            ok = value > low if is_float_field else value >= low
            if not ok or value != value or value == float("inf"):
                bound = f"> {low}" if is_float_field else f">= {low}"
                raise ValueError(f"SandboxLimits.{f.name}: {value!r} is out of range; it must be finite and {bound}")

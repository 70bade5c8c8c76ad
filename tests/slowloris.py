"""Slowloris for the server tests: many connections that each send part of a request header, then nothing."""

from __future__ import annotations

import contextlib
import resource
import socket
from typing import Iterator
from urllib.parse import urlsplit

PARTIAL_HEADER = b"POST /episodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nX-Slow: "
SERVER_NOFILE = 1024  # the attacked server's open-file limit (a common default)


def limit_open_files(n: int = SERVER_NOFILE) -> None:
    """In a child process before it runs the server: ``ulimit -n n``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


@contextlib.contextmanager
def slow_sockets(url: str, n: int = 1100) -> Iterator[list[socket.socket]]:
    """``n`` connections to ``url``, each holding a partial header, closed on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 256:  # this (attacking) process needs its own n sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n + 256, hard), hard))
    parts = urlsplit(url)
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection((parts.hostname, parts.port), timeout=10)
            s.sendall(PARTIAL_HEADER)
            held.append(s)
        yield held
    finally:
        for s in held:
            s.close()


def stalled_body(path: str = "/v1/completions", length: int = 100000, headers: str = "") -> bytes:
    """A complete request header announcing ``length`` body bytes, and the first byte of the body only."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {length}\r\n\r\n{{").encode()


@contextlib.contextmanager
def stalled_bodies(url: str, n: int, request: bytes | None = None) -> Iterator[list[socket.socket]]:
    """``n`` connections to ``url``, each with a complete header and a body that stalls after one byte (``request``:
    what each sends; :func:`stalled_body` by default), closed on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n + 256, hard), hard))
    parts = urlsplit(url)
    held: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.create_connection((parts.hostname, parts.port), timeout=10)
            s.sendall(request or stalled_body())
            held.append(s)
        yield held
    finally:
        for s in held:
            s.close()

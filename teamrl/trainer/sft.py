"""``teamrl sft``: warm start. Fine-tune each role's policy on demonstrations before RL.

A demonstration is (role, messages, completion): the chat a role was shown and the reply it
should give. They come from a JSONL file (one ``{"role": ..., "messages": [...] or "text",
"completion": "..."}`` per line) or from the task's own solver: an optional task method
``demonstrations(problem) -> list[(role, messages, completion)]`` (``math.solve``'s known
answers, ``plan_path``'s shortest paths and BFS program). Without either, the team's own successful
episodes can be the demonstrations (``teamrl sft --self-play N`` / ``--from-episodes PATH``:
:mod:`teamrl.trainer.self_play`, which trains on the token ids the calls recorded through
:func:`sft_router`, :func:`sft_epochs` and :func:`save_warm_start` here).

The policies, adapters, checkpoints and run directory are RL's own (:class:`PolicyRouter`,
:mod:`teamrl.trainer.checkpoint`, ``runs/<name>/``); the loss is the cross-entropy of the
completion tokens only (prompt and padding carry none), computed with the RL loss's log-prob
code. The warm-started weights are saved as checkpoint ``step_000000`` with a fresh optimizer
(RL's learning rate, no SFT moments), so ``teamrl train CONFIG --resume`` (same ``name``)
starts RL from them at step 0. They are also kept in ``RUN_DIR/warm_start/`` (out of the rotation of
``checkpoints/``) and described in ``RUN_DIR/warm_start.json``, so that train, eval and report can
compare RL with its warm start.
"""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from teamrl.core.config import Config, ConfigError, InputError, InputFileMissing, config_to_dict
from teamrl.core.metrics import ProgressLines
from teamrl.core.seeding import derive_seed, seed_everything
from teamrl.policies.chat import Messages, assistant_text, encode_chat
from teamrl.policies.logprobs import build_token_batch, completion_logprobs, to_device
from teamrl.policies.policy import Policy
from teamrl.policies.router import PolicyRouter
from teamrl.tasks import Problem, make_task
from teamrl.trainer.checkpoint import list_checkpoints, record_warm_start, save_checkpoint

WARM_START_STEP = 0  # the checkpoint step of the warm start: RL resumes from it at step 0


@dataclass(frozen=True)
class Demonstration:
    """What ``role`` was shown (``messages``) and the reply it should give (``completion``)."""

    role: str
    messages: Messages | str
    completion: str
    tools: list[dict[str, Any]] | None = None  # the tools the prompt offers, rendered as a gateway request's are


def _message_ok(m: Any) -> bool:
    """A chat message: a role and text content, or an assistant's tool calls (content may then be null)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    calls = m.get("tool_calls")
    if calls is not None:
        return m["role"] == "assistant" and _tool_calls_ok(calls) and isinstance(m.get("content") or "", str)
    return isinstance(m.get("content"), str)


def _tool_calls_ok(calls: Any) -> bool:
    return isinstance(calls, list) and bool(calls) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls)


def _demonstration(row: Any, where: str) -> Demonstration:
    """One demonstration from a JSONL object or a (role, messages, completion) tuple; ``where`` names it in errors.
    A JSONL object may also give ``tools``, and its completion as an assistant message (``content``, ``tool_calls``):
    it is trained as the text a model writes for it (:func:`~teamrl.policies.chat.assistant_text`)."""
    tools = None
    if isinstance(row, dict):
        missing = [k for k in ("role", "messages", "completion") if k not in row]
        if missing:
            raise InputError(f"{where}: missing {missing}; a demonstration has role, messages and completion")
        role, messages, completion, tools = row["role"], row["messages"], row["completion"], row.get("tools")
    elif isinstance(row, (tuple, list)) and len(row) == 3:
        role, messages, completion = row
    else:
        raise InputError(f"{where}: {row!r:.80} is not a demonstration; expected (role, messages, completion)")
    if not isinstance(role, str) or not role:
        raise InputError(f"{where}: role {role!r} must be a non-empty string")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise InputError(f"{where}: tools {tools!r:.80} must be a list of OpenAI tool specs "
                         "({type: function, function: {name, description, parameters}})")
    if isinstance(completion, dict):
        calls = completion.get("tool_calls")
        if (calls is not None and not _tool_calls_ok(calls)) or not isinstance(completion.get("content") or "", str):
            raise InputError(f"{where}: completion {completion!r:.80} must be text or an assistant message "
                             "{content, tool_calls: [{function: {name, arguments}}]}")
        completion = assistant_text(completion)
    if not isinstance(completion, str) or not completion.strip():
        raise InputError(f"{where}: completion {completion!r:.60} must be a non-empty string")
    if not (isinstance(messages, str) or (isinstance(messages, list) and messages and all(map(_message_ok, messages)))):
        raise InputError(
            f"{where}: messages {messages!r:.80} must be a string or a list of {{role, content}} chat messages"
        )
    return Demonstration(role, messages, completion, tools)


def encode_demonstration(tokenizer: Any, d: Demonstration) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of ``d``: the prompt rendered as every call's is (its tools included), the
    completion's tokens and EOS (the reply learns to stop)."""
    completion = tokenizer(d.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return encode_chat(tokenizer, d.messages, d.tools), completion


def load_demonstrations(path: str | Path) -> list[Demonstration]:
    """The demonstrations of a JSONL file (one object per non-empty line)."""
    path = Path(path)
    if not path.is_file():
        raise InputFileMissing(f"--data {path}: no such file (expected JSONL rows with role, messages, completion)")
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"--data {path}:{i}: not JSON ({e.msg})") from None
        out.append(_demonstration(row, f"--data {path}:{i}"))
    if not out:
        raise InputError(f"--data {path}: no demonstrations in it")
    return out


def task_demonstrations(task: Any, problems: Sequence[Problem]) -> list[Demonstration]:
    """The task's own demonstrations (its ``demonstrations(problem)`` method) of ``problems``."""
    hook = getattr(task, "demonstrations", None)
    if hook is None:
        raise ConfigError(f"task {task.name!r} has no demonstrations(problem) method (no solver to learn from); "
                          "pass --data FILE.jsonl with rows of role, messages, completion")
    demos = [_demonstration(row, f"task {task.name!r}: demonstrations(problem {p.id!r})[{j}]")
             for p in problems for j, row in enumerate(hook(p))]
    if not demos:
        raise InputError(f"task {task.name!r}: demonstrations() gave none for its {len(problems)} problems "
                         "(its data may have no known solutions); pass --data FILE.jsonl")
    return demos


def run_demonstrations(cfg: Config, task: Any, problems: Sequence[Problem]) -> list[Demonstration]:
    """This run's warm-start demonstrations of ``problems``: its workflow's (``workflow.name`` with a
    ``demonstrations`` hook, e.g. voting and eval_opt: each role in the workflow's own prompts and format), else
    the task's own (:func:`task_demonstrations`)."""
    from teamrl.algorithms import configured_workflow_options
    from teamrl.workflows import WORKFLOWS

    spec = WORKFLOWS.get_entry(cfg.workflow.name, "workflow.name") if cfg.workflow.name else None
    if spec is None or spec.demonstrations is None:
        return task_demonstrations(task, problems)
    options = configured_workflow_options(cfg)
    demos = [_demonstration(row, f"workflow {cfg.workflow.name!r}: demonstrations(problem {p.id!r})[{j}]")
             for p in problems for j, row in enumerate(spec.demonstrations(task, p, options))]
    if not demos:
        raise InputError(f"workflow {cfg.workflow.name!r}: demonstrations() gave none for task {task.name!r}'s "
                         f"{len(problems)} problems (its data may have no known solutions); pass --data FILE.jsonl")
    return demos


def sft_loss(model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
             pad_id: int) -> tuple[torch.Tensor, int]:
    """(mean cross-entropy per completion token, completion token count): the prompt and the padding carry no loss."""
    batch = to_device(build_token_batch(prompts, completions, pad_id), next(model.parameters()).device)
    logp, _ = completion_logprobs(model, batch)
    mask = batch.completion_pad_mask.to(logp.dtype)
    tokens = int(mask.sum())
    return -(logp * mask).sum() / max(tokens, 1), tokens


def sft_step(policy: Policy, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
             max_grad_norm: float, micro_batch_size: int) -> float | None:
    """One optimizer step of ``policy`` on the cross-entropy of these demonstrations (token mean);
    returns the loss, or None when the loss or gradient was not finite (the step is skipped)."""
    total = sum(len(c) for c in completions)
    policy.optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    with policy.active() as model:
        model.train()
        for start in range(0, len(prompts), micro_batch_size):
            sl = slice(start, start + micro_batch_size)
            loss, tokens = sft_loss(model, prompts[sl], completions[sl], pad_id)
            (loss * tokens / total).backward()
            loss_sum += float(loss.detach()) * tokens / total
    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm))
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):  # nothing non-finite reaches the weights
        policy.optimizer.zero_grad(set_to_none=True)
        print(f"warning: sft: policy {policy.name!r}: non-finite loss or gradient; step skipped", file=sys.stderr)
        return None
    policy.step()
    policy.optimizer.zero_grad(set_to_none=True)
    return loss_sum


def warm_start(cfg: Config, demonstrations: Sequence[Demonstration], epochs: int = 3, batch_size: int = 8,
               lr: float | None = None, progress: bool = True, source: str = "") -> tuple[Path, list[dict[str, float]]]:
    """Fine-tune the config's policies on ``demonstrations`` and save them as the run's step-0 checkpoint.

    Each policy steps on its own roles' demonstrations, ``batch_size`` at a time, ``epochs``
    passes in a seeded order. Returns (run directory, one record per optimizer step:
    epoch, step, policy, loss). The per-step records also go to ``RUN_DIR/sft.jsonl``; the warm
    start is also kept in ``RUN_DIR/warm_start/`` with what it was trained on (``source``: where
    the demonstrations came from) in ``RUN_DIR/warm_start.json``
    (:func:`~teamrl.trainer.checkpoint.record_warm_start`), for RL's comparisons with it.
    """
    if epochs < 1 or batch_size < 1:
        raise ConfigError(f"sft: --epochs {epochs} and --batch-size {batch_size} must be >= 1")
    fresh_run_dir(cfg)
    router, roles = sft_router(cfg, lr)
    tok = router.tokenizer
    by_policy: dict[str, list[TokenRow]] = {}
    for d in demonstrations:
        try:
            name = router.policy_name(d.role)
        except KeyError:
            raise InputError(f"sft: a demonstration's role {d.role!r} is not a role of this run; its roles are {roles} "
                             "(teamrl sft --as-role ROLE trains one of them on the task's demonstrations)") from None
        by_policy.setdefault(name, []).append(encode_demonstration(tok, d))
    records = sft_epochs(cfg, router, by_policy, epochs, batch_size, progress)
    trained_on = {
        "source": source, "demonstrations": len(demonstrations),
        "roles": {r: sum(d.role == r for d in demonstrations) for r in dict.fromkeys(d.role for d in demonstrations)},
        "epochs": epochs, "batch_size": batch_size, "lr": lr or cfg.train.lr,
    }
    return save_warm_start(cfg, router, records, trained_on), records


TokenRow = tuple[list[int], list[int]]  # (prompt token ids, completion token ids) of one training call


def fresh_run_dir(cfg: Config) -> Path:
    """The run directory a warm start writes; refused when it already holds checkpoints."""
    run_dir = Path(cfg.run.dir) / cfg.name
    if list_checkpoints(run_dir / "checkpoints"):
        raise ConfigError(
            f"sft: run directory {run_dir} already has checkpoints; warm-start a new run (choose another name=)"
        )
    return run_dir


def sft_router(cfg: Config, lr: float | None = None) -> tuple[PolicyRouter, list[str]]:
    """(the run's policies, seeded, at SFT's learning rate ``lr`` (default ``train.lr``); the roles RL will train)."""
    from teamrl.algorithms import make_algorithm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    task = make_task(cfg.task)
    roles = list(getattr(make_algorithm(cfg, task), "roles", None) or task.roles)  # the roles RL will train
    router = PolicyRouter(cfg.policy.mode, roles, cfg.model, cfg.policy.lora, lr=lr or cfg.train.lr,
                          weight_decay=cfg.train.weight_decay, seed=cfg.seed, device=cfg.policy.device,
                          dtype=cfg.policy.dtype, role_map=cfg.policy.roles)
    return router, roles


def sft_epochs(cfg: Config, router: PolicyRouter, by_policy: dict[str, list[TokenRow]], epochs: int, batch_size: int,
               progress: bool, first_step: int = 0) -> list[dict[str, float]]:
    """``epochs`` seeded passes of each policy over its own rows, ``batch_size`` rows per optimizer step
    (:func:`sft_step`); one record per step (epoch, step, policy, loss, demonstrations), steps counted from
    ``first_step``."""
    tok = router.tokenizer
    records: list[dict[str, float]] = []
    step = first_step
    total = epochs * sum(math.ceil(len(rows) / batch_size) for rows in by_policy.values())
    steps = ProgressLines("[teamrl sft]", total, "steps", enabled=progress)
    steps.update(0)
    for epoch in range(1, epochs + 1):
        for name, rows in by_policy.items():
            order = list(range(len(rows)))
            random.Random(derive_seed(cfg.seed, epoch, 11)).shuffle(order)
            for start in range(0, len(order), batch_size):
                part = [rows[i] for i in order[start:start + batch_size]]
                loss = sft_step(router.policies[name], [p for p, _ in part], [c for _, c in part], tok.pad_token_id,
                                cfg.train.max_grad_norm, cfg.train.micro_batch_size)
                step += 1
                records.append(
                    {
                        "epoch": epoch,
                        "step": step,
                        "policy": name,
                        "loss": float("nan") if loss is None else loss,
                        "demonstrations": len(part),
                    }
                )
                which = {"policy": name} if len(by_policy) > 1 else {}
                steps.update(step - first_step, **which, loss=f"{records[-1]['loss']:.3f}")
        if progress:
            last = {r["policy"]: r["loss"] for r in records if r["epoch"] == epoch}
            print(f"[teamrl sft] epoch {epoch}/{epochs}: " + ", ".join(f"{k} loss {v:.3f}" for k, v in last.items()),
                  file=sys.stderr, flush=True)
    return records


def save_warm_start(cfg: Config, router: PolicyRouter, records: Sequence[dict[str, Any]],
                    trained_on: dict[str, Any] | None = None) -> Path:
    """Save ``router``'s policies as the run's checkpoint ``step_000000`` (``warm_start: True`` and ``trained_on``,
    what the warm start learned from, in its trainer state) with RL's fresh optimizer; the config and the SFT step
    records (``sft.jsonl``) beside it. Returns the run directory."""
    run_dir = fresh_run_dir(cfg)
    for policy in router.policies.values():  # RL starts with its own learning rate and no SFT moments
        policy.optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    state: dict[str, Any] = {"data_position": 0, "warm_start": True}
    if trained_on:
        state["trained_on"] = trained_on
    saved = save_checkpoint(run_dir / "checkpoints", WARM_START_STEP, router, state)
    record_warm_start(run_dir, saved, {"trained_by": "teamrl sft", **(trained_on or {}), "sft_steps": len(records)})
    (run_dir / "metrics.jsonl").touch()  # RL's metrics start here when it resumes from the warm start
    with (run_dir / "sft.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return run_dir

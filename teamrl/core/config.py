"""The config schema: typed dataclasses, validated before any model loads.

A config is a YAML file plus ``key.sub=value`` overrides. Every field declares its type and,
where it matters, its allowed values or range; an unknown key, a wrong type or an
out-of-range value fails with one line that names the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar



from teamrl.core.errors import ConfigError, InputError, InputFileMissing  # noqa: F401  (their home before)
from teamrl.core.options import (BYTES_PER_SAMPLE, BYTES_PER_TOKEN, MAX_NAME_BYTES, coerce, build_dataclass,
                                 check_fields, check_memory, option)
from teamrl.core.yaml_io import (MAX_CONFIG_BYTES, MAX_YAML_REPEATS, set_path, load_yaml,  # noqa: F401
                                 parse_overrides, read_yaml_mapping)


@dataclass
class LoraConfig:
    r: int = option(16, ge=1, doc="LoRA rank (at most the width of the model's targeted layers)")
    alpha: float = option(32.0, gt=0, doc="LoRA scaling numerator (scale = alpha / r)")
    dropout: float = option(0.0, ge=0, le=1, doc="dropout on the LoRA input")
    target_modules: list[str] = option(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        doc="module names that get adapters",
    )


PLACEMENTS = ("local", "ray")
# The Ray actor options a worker may ask for (policy.resources.<worker>)
WORKER_RESOURCES = ("num_cpus", "num_gpus", "memory", "resources")


@dataclass
class PolicyConfig:
    mode: str = option(
        "shared",
        choices=("shared", "lora_per_role", "separate"),
        doc="shared: one set of weights for every role; lora_per_role: one LoRA adapter per role type on one base; "
        "separate: one model per role",
    )
    lora: LoraConfig | None = option(
        factory=LoraConfig, doc="LoRA settings; null trains full weights (not allowed with lora_per_role)"
    )
    equalize_steps: bool = option(True, doc="one optimizer step per policy per iteration; false: one per role instance "
                                            "(generator0..2 then step the shared generator adapter three times)")
    device: str = option(
        "auto", doc="where the models live: auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N"
    )
    dtype: str = option("auto", choices=("auto", "float32", "bfloat16", "float16"),
                        doc="model weights dtype; auto is bfloat16 on CUDA and float32 on CPU")
    roles: dict[str, str] = option(
        factory=dict,
        doc="explicit role -> policy map, e.g. {critic: critic, critic2: critic} "
        "(lora_per_role / separate): every role must be listed, roles with one "
        "policy name share it; empty: each declared role has its own policy "
        "(critic2, gpt4 included) and numbered instances the workflow "
        "creates (generator0 of generator) share their role's",
    )
    placement: str = option(
        "local",
        choices=PLACEMENTS,
        doc="where each policy's worker (model, adapters, optimizer) lives: local (the driver's process; "
        "the reference for correctness) or ray (one Ray actor per worker, see docs/scale.md)",
    )
    workers: dict[str, list[str]] = option(
        factory=dict,
        doc="ray: worker name -> the policies it holds (they share its "
        "base model), e.g. {base: [main, sub]}; empty: one worker per "
        "policy, named after it",
    )
    resources: dict[str, dict[str, Any]] = option(
        factory=dict,
        doc="ray: worker name -> Ray actor resources "
        f"({', '.join(WORKER_RESOURCES)}), e.g. "
        "{proposer: {num_gpus: 1}, critic: {resources: {node_b: 1}}}; "
        "a worker not listed asks for num_cpus 1",
    )
    ray_address: str = option("", doc="ray: address of a running cluster (ray start --head prints it; auto: the one on "
                                      "this machine); empty: a Ray already initialised in this process, else a local "
                                      "cluster of the run's own (never another run's)")
    ray_timeout_s: float = option(600.0, gt=0, doc="ray: seconds to wait for a worker's answer before failing with an "
                                                   "error naming it")
    ranks: dict[str, int] = option(
        factory=dict,
        doc="ray: worker name -> how many ranks train its policies together, e.g. {base: 2}: data parallel over one "
        "torch.distributed group, parameters, gradients and optimizer state sharded (FSDP2), each rank a Ray actor "
        "with the worker's policy.resources, all in one placement group (docs/scale.md); a worker not listed has 1",
    )
    collective_timeout_s: float = option(
        600.0, gt=0, doc="policy.ranks above 1: seconds a rank waits for the others in a collective before its "
        "update fails naming it"
    )
    activation_checkpointing: bool = option(
        False, doc="policy.ranks above 1: recompute each decoder layer's activations in the backward pass instead "
        "of keeping them from the forward (less memory, one more forward)"
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts


@dataclass
class VllmConfig:
    """``rollout.engine=vllm``: the vLLM server teamrl starts for the run (teamrl/rollout/vllm_server.py)."""

    python: str = option(
        "",
        doc="the Python that has vLLM (runs -m vllm.entrypoints.openai.api_server); empty: "
        ".venv-vllm/bin/python of the current folder, else of the teamrl checkout (make setup-vllm)",
    )
    command: list[str] = option(
        factory=list,
        doc="instead of python: the command that starts vLLM's OpenAI server, "
        "e.g. [vllm, serve] or [/opt/vllm/bin/python, -m, "
        "vllm.entrypoints.openai.api_server]; teamrl appends --model and the flags",
    )
    host: str = option("127.0.0.1", doc="address the server binds (and teamrl connects to)")
    port: int = option(0, ge=0, le=65535, doc="the server's port; 0: a free one")
    max_loras: int = option(0, ge=0, doc="--max-loras, adapters decoded together; 0: the run's number of policies "
                                         "(vLLM's default of 1 would make the roles take turns)")
    max_lora_rank: int = option(0, ge=0, doc="--max-lora-rank; 0: policy.lora.r rounded up to a rank vLLM takes "
                                             f"({', '.join(map(str, VLLM_LORA_RANKS))})")
    max_model_len: int = option(2048, ge=1, doc="--max-model-len: prompt plus completion tokens the server holds")
    kvcache_gb: int = option(2, ge=1, doc="CPU only: GB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = option(0.5, gt=0, le=1, doc="CUDA only: --gpu-memory-utilization, the share of the "
                                                                "GPU vLLM takes (the trainer needs the rest)")
    extra_args: list[str] = option(factory=list, doc="more vLLM flags, appended as given (e.g. [--enforce-eager])")
    env: dict[str, str] = option(factory=dict, doc="more environment variables for the server "
                                                   "(e.g. {VLLM_CPU_OMP_THREADS_BIND: '1'})")
    startup_timeout_s: float = option(600.0, gt=0, doc="seconds to wait for the server to answer before failing "
                                                       "(28-71 s on 2 shared CPU cores)")
    servers: int = option(1, ge=1, doc="how many servers to start (a pool: each policy's requests spread over them, "
                                       "every server synced after each update); each has its own port (port + i when "
                                       "port is set), KV cache, --max-loras and log RUN_DIR/vllm_server_<i>.log")
    resources: dict[str, Any] = option(factory=lambda: {"num_cpus": 1},
                                       doc="policy.placement ray: the Ray resources of each server's actor "
                                           f"({', '.join(WORKER_RESOURCES)}), e.g. {{num_gpus: 1}}")
    spread: bool = option(False, doc="policy.placement ray: one server per node (a STRICT_SPREAD placement group); "
                                     "the run fails in one line when the cluster has fewer nodes than servers")


@dataclass
class RolloutConfig:
    group_size: int = option(8, ge=1, doc="samples per prompt (G)", bytes_each=BYTES_PER_SAMPLE)
    batch_size: int = option(4, ge=1, doc="problems per step", bytes_each=BYTES_PER_SAMPLE)
    max_new_tokens: int = option(48, ge=1, doc="completion length limit (at most the model's context)",
                                 bytes_each=BYTES_PER_TOKEN)
    temperature: float = option(1.0, ge=0, doc="sampling temperature; 0 is greedy")
    top_p: float = option(1.0, gt=0, le=1, doc="nucleus sampling mass")
    top_k: int = option(0, ge=0, doc="keep the k most likely tokens; 0 keeps all")
    stop: list[str] = option(factory=list, doc="stop strings (the completion is cut after the first one)")
    ignore_eos: bool = option(False, doc="generate exactly max_new_tokens, ignoring EOS (benchmarks)")
    min_new_tokens: int = option(
        0, ge=0, doc="EOS cannot be drawn before this many tokens (HF min_new_tokens, vLLM min_tokens)"
    )
    max_staleness: int = option(
        0,
        ge=0,
        doc="k: the rollouts of the next k steps are sampled while a step trains, each with "
        "weights at most k updates behind the ones it is trained against; 0: rollout, "
        "update and weight sync one after another (docs/rollout_and_serving.md)",
    )
    engine: str = option(
        "hf",
        choices=("hf", "http", "vllm"),
        doc="hf: generate in this process; http: send rollouts to an OpenAI-compatible server (teamrl serve, vLLM, "
        "SGLang) at server_url; vllm: start a vLLM server for the run (rollout.vllm), stop it with the run",
    )
    server_url: str = option("http://127.0.0.1:8000", doc="base URL of the server used by engine http")
    server_urls: list[str] = option(factory=list, doc="engine http: several servers' base URLs (a pool: each policy's "
                                                      "requests spread over them, every one synced after each update); "
                                                      "when given, server_url is not used")
    on_endpoint_failure: str = option(
        "continue",
        choices=("continue", "stop"),
        doc="a pool endpoint that stops answering (refused, reset, timed out, its process "
        "gone): continue on the others (its requests re-sent), or stop the run; "
        "either way one line names it",
    )
    request_deadline_s: float = option(
        900.0,
        gt=0,
        doc="engine http/vllm: the longest one request to a rollout server may "
        "take, first byte to last (the read timeout is per read: an answer "
        "dribbled a byte at a time never trips it); past it the endpoint "
        "counts as failed (rollout.on_endpoint_failure)",
    )
    adapter_dir: str = option(
        "",
        doc="engine http: folder the server can read where adapters are saved after each update; empty: "
        "RUN_DIR/served_adapters",
    )
    server_dialect: str = option(
        "auto",
        choices=("auto", "vllm", "sglang", "teamrl"),
        doc="engine http: the server's API (paths, seeding, limits); auto reads owned_by of /v1/models",
    )
    server_check: bool = option(
        True,
        doc="engine http: before training, sample one group of a probe prompt and refuse to train if "
        "its samples are identical or the server's log-probs differ from the trainer's "
        "(under the run's temperature, top-k and top-p)",
    )
    server_sync_check: bool = option(
        True,
        doc="engine http: after every adapter load, check on a short greedy probe that the server's "
        "log-probs equal the trainer's for that version; a mismatch fails the step naming "
        "the policy and version",
    )
    server_check_tolerance: float = option(
        1e-3,
        gt=0,
        doc="engine http: the largest absolute difference of one token's log-prob "
        "between server and trainer that the start-up and sync checks accept "
        "(fp32 vLLM on CPU measured <= 6e-5; raise it for bf16)",
    )
    vllm: VllmConfig = option(factory=VllmConfig, doc="engine vllm: the server teamrl starts and stops")


# The KL weight toward the warm start a run that began from one takes by default (train.loss.kl_coef: null). On
# reverse_text (seed 0, 20 GRPO steps at lr 5e-4), 0.05 let the adapter drift 1.9 nats/token from its warm start and
# lose 0.053 held out; 0.5 kept it at most 0.44 and the warm start's score (+0.039 +/- 0.024): docs/learning.md.
WARM_START_KL_COEF = 0.5


@dataclass
class LossConfig:
    """The ``train.loss`` section, and what :func:`teamrl.losses.policy_loss` reads: each field declared once, here.

    Built from a config or directly in Python, its values are checked by one mechanism (:func:`check_fields`, the
    config's own type, choice and range checks), with the same one-line message (``train.loss.eps_low: ...`` from a
    config, ``LossConfig.eps_low: ...`` from Python). The values derived from other sections, ``importance_correction:
    auto`` and dr_grpo's ``max_completion_length``, are resolved in one place: :meth:`resolve`.
    """

    eps_low: float = option(0.2, ge=0, le=1, doc="lower PPO clip: ratio >= 1 - eps_low")
    eps_high: float = option(0.2, ge=0, doc="upper PPO clip: ratio <= 1 + eps_high (DAPO clip-higher when > eps_low)")
    dual_clip: float | None = option(None, gt=1, doc="dual-clip constant c > 1 for negative advantages; null disables")
    kl_coef: float | None = option(
        None, ge=0,
        doc="weight of the k3 KL to the reference (train.loss.kl_reference); null (the default): "
            f"{WARM_START_KL_COEF} toward the warm start in a run that began from one (teamrl sft), 0 otherwise")
    kl_reference: str = option(
        "auto", choices=("auto", "base", "warm_start"),
        doc="what the KL term pulls toward: base (the base model, adapters off), warm_start (the weights teamrl sft "
            "saved, the run's step 0), auto: the warm start when the run began from one, else the base")
    kl_bias_correction: bool = option(
        False,
        doc="multiply k3 by the importance ratio (unbiased KL gradient; TRL 1.16's "
        "use_bias_correction_kl, default true there); false: plain k3",
    )
    aggregation: str = option(
        "token_mean",
        choices=("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"),
        doc="how token losses become one number (token_mean is TRL's dapo, seq_mean_token_mean TRL's grpo)",
        hints={
            "dapo": "TRL's 'dapo' is 'token_mean' here",
            "grpo": "TRL's 'grpo' is 'seq_mean_token_mean' here",
            "bnpo": "TRL's 'bnpo' (mean of each micro-batch's token mean) is not offered; 'token_mean' is TRL's 'dapo'",
        },
    )
    importance_correction: str = option(
        "auto", choices=("auto", "token", "sequence", "none"),
        doc="multiply each token's clipped policy loss (not the KL) by the truncated importance weight "
            "min(exp(old - sampling log-prob), importance_cap): per token, or one per sample from the summed "
            "log-ratio (sequence); auto: token when rollout.max_staleness > 0, else none",
        hints={"token_truncate": "TRL's 'token_truncate' is 'token' here",
               "sequence_truncate": "TRL's 'sequence_truncate' is 'sequence' here",
               "token_mask": "TRL's 'token_mask' (drop tokens over the cap) is not offered",
               "sequence_mask": "TRL's 'sequence_mask' (drop samples over the cap) is not offered"})
    importance_cap: float = option(2.0, gt=0, doc="upper bound of the importance weight (truncation; verl's "
                                                  "rollout_is_threshold, TRL's vllm_importance_sampling_cap, "
                                                  "now _clip_max); docs/algorithms.md")
    max_completion_length: int | None = option(None, ge=1, internal=True,
                                               doc="dr_grpo's constant denominator: rollout.max_new_tokens (resolve)")

    def __post_init__(self) -> None:
        check_fields(self, "LossConfig.")

    def with_warm_start(self, warm_start: bool) -> LossConfig:
        """This loss with ``kl_coef: null`` resolved: :data:`WARM_START_KL_COEF` in a run that began from a warm start
        (unless ``kl_reference`` is ``base``: the default weight is for a KL to the warm start), else 0."""
        if self.kl_coef is not None:
            return self
        coef = WARM_START_KL_COEF if warm_start and self.kl_reference != "base" else 0.0
        return dataclasses.replace(self, kl_coef=coef)

    def resolve(self, max_staleness: int = 0, max_new_tokens: int | None = None) -> LossConfig:
        """This loss with its derived values resolved (the one place they are): ``importance_correction: auto`` is
        ``token`` when rollouts may be stale (``rollout.max_staleness`` > 0) and ``none`` otherwise, so a synchronous
        run's loss is unchanged; dr_grpo's ``max_completion_length`` is ``max_new_tokens`` (``rollout.max_new_tokens``)
        when given. ``policy_loss`` resolves an ``auto`` it is given as on-policy (``max_staleness`` 0)."""
        mode = self.importance_correction
        if mode == "auto":
            mode = "token" if max_staleness > 0 else "none"
        length = (
            max_new_tokens
            if self.aggregation == "dr_grpo" and max_new_tokens is not None
            else self.max_completion_length
        )
        resolved = self.with_warm_start(False)  # a kl_coef still null here has no warm start to pull toward
        return dataclasses.replace(resolved, importance_correction=mode, max_completion_length=length)


# whose samples an advantage is normalised over (train.advantage_scope; the trainer's comparison_keys)
ADVANTAGE_SCOPES = ("agent", "team")


@dataclass
class TrainConfig:
    steps: int = option(20, ge=1, doc="optimizer iterations")
    lr: float = option(2e-4, gt=0, le=1, doc="learning rate (AdamW)")
    weight_decay: float = option(0.0, ge=0, doc="AdamW weight decay")
    max_grad_norm: float = option(1.0, gt=0, doc="gradient clipping norm per policy")
    noise_grad_norm: float = option(
        1e-5,
        ge=0,
        doc="a policy's gradient norm (before clipping) at most this is float rounding, not signal: no optimizer step "
        "(skipped_no_signal/<policy>; Adam would scale it to a full step). float32 rounding of a cancelled gradient of "
        "scale 1 is ~1e-7 (measured: 1.5e-7 to 6e-7); raise it for bf16 compute; 0: never",
    )
    ppo_epochs: int = option(1, ge=1, doc="passes over each batch; with 1, old log-probs are the detached current ones")
    micro_batch_size: int = option(
        16,
        ge=1,
        doc="completions per forward/backward pass (gradient accumulation, "
        "the same gradient); a prompt with more completions runs once, its completions in passes",
    )
    advantage: str = option(
        "group", choices=("group", "mean", "batch", "none", "rloo", "max"), doc="group normalisation mode"
    )
    advantage_eps: float = option(1e-4, gt=0, doc="epsilon added to the std")
    advantage_scope: str = option(
        "agent",
        choices=ADVANTAGE_SCOPES,
        doc="whose samples one advantage is normalised over: agent, the algorithm's own comparison groups (each role "
        "against itself: Dr. MAS's agent-wise normalisation); team, one group per problem pooling every role's and "
        "turn's samples (the global GRPO normalisation Dr. MAS compares with)",
    )
    nonfinite_reward: str = option(
        "error",
        choices=("error", "drop_group"),
        doc="a NaN/inf reward: error (names task, problem and role) or drop_group (its comparison "
        "group is left out of the update and counted in nonfinite_groups_dropped)",
    )
    loss: LossConfig = option(factory=LossConfig)
    role_grad_norms: bool = option(False, doc="log each role type's loss, entropy and gradient norm on a shared policy "
                                              "(role capture); costs a gradient copy per role")
    eval_every: int = option(0, ge=0, doc="evaluate greedy accuracy on the held-out split every N steps; 0: never")
    eval_problems: int = option(16, ge=1, doc="held-out problems per evaluation")
    cliff_points: float = option(
        10.0, gt=0, doc="an evaluation this many accuracy points under the running peak is a cliff: warn"
    )
    cliff_stop: bool = option(False, doc="stop training at an accuracy cliff (the best checkpoint is kept either way)")
    final_eval_problems: int = option(
        0,
        ge=0,
        doc="after training, evaluate the untrained and the trained team greedily on "
        "this many held-out problems, side by side with a paired comparison; 0: off",
    )


@dataclass
class WorkflowConfig:
    name: str = option(
        "",
        doc="a registered workflow (teamrl.api.WORKFLOWS; yours with @register_workflow and --plugin) "
        "or package.module:object, trained by any algorithm that does not refuse it (docs/algorithm_matrix.md); "
        "empty: the task's default workflow",
    )
    reward: str = option(
        "outcome",
        doc="a registered reward (teamrl.api.REWARDS) of each sample, applied by algorithm grpo: "
        "outcome (every sample gets the episode's team return), per_role (a sample's own "
        "role_reward where the workflow sets one), or yours (@register_reward); magrpo, "
        "at_grpo and m_grpo credit the rewards the workflow reports their own way and "
        "accept outcome only",
    )
    options: dict[str, Any] = option(
        factory=dict, doc="the options of a workflow that declares its own Options dataclass (validated against it)"
    )


@dataclass
class RunConfig:
    dir: str = option("runs", doc="parent folder of run directories")
    save_every: int = option(10, ge=1, doc="checkpoint every N steps (and at the end)")
    keep_checkpoints: int = option(2, ge=1, doc="how many recent checkpoints to keep")
    log_episodes: bool = option(True, doc="write sampled episodes to episodes/step_000001.jsonl, one file per step")
    progress: bool = option(True, doc="show progress on stderr (the training bar; teamrl sft and eval progress lines)")
    tensorboard: bool = option(True, doc="also write metrics as TensorBoard events under tensorboard/")
    wandb: bool = option(False, doc="also log to Weights & Biases (needs `pip install wandb` and a login)")
    wandb_project: str = option("teamrl", doc="W&B project name")


S = TypeVar("S")


@dataclass
class Config:
    name: str = option("run", doc="run name; the run directory is run.dir/name")
    seed: int = option(0, ge=0, le=2**63 - 1, doc="seed for data order, sampling and initialisation")
    model: str = option(
        "smollm2-135m",
        doc="alias (smollm2-135m, tiny-random, random:smollm2-135m, random:qwen3-1.7b), local folder, or hub id",
    )
    threads: int = option(0, ge=0, doc="torch CPU threads; 0 keeps torch's default")
    algorithm: str = option("grpo", doc="training algorithm: a registered one (teamrl.algorithms.ALGORITHMS); its own "
                                         "options are the top-level section of its name")
    task: dict[str, Any] = option(factory=lambda: {"name": "word_count"}, doc="task name and its own options")
    policy: PolicyConfig = option(factory=PolicyConfig)
    rollout: RolloutConfig = option(factory=RolloutConfig)
    train: TrainConfig = option(factory=TrainConfig)
    workflow: WorkflowConfig = option(factory=WorkflowConfig)
    run: RunConfig = option(factory=RunConfig)
    # the registered sections as loaded (a field, so that dataclasses.replace keeps them); not a config key
    sections: dict[str, Any] = field(default_factory=dict, repr=False, metadata={"internal": True})

    def section(self, cls: type[S]) -> S:
        """A registered section (:func:`register_section`) by its dataclass (an algorithm's, e.g.), typed: as loaded,
        or its
        defaults."""
        names = [name for name, c in SECTIONS.items() if c is cls]
        if not names:
            raise KeyError(f"{cls.__name__} is not a registered config section; registered: "
                           f"{sorted(c.__name__ for c in SECTIONS.values())}")
        return self.sections.setdefault(names[0], cls())


# ---- what higher layers add to the config (core names none of them) -----------------------------
SECTIONS: dict[str, type] = {}  # top-level section name -> its dataclass (each algorithm's own options)
CHECKS: list[Callable[[Config], None]] = []  # cross-field checks of the layers that registered sections
CHOICES: dict[str, Callable[[], list[str]]] = {}  # a top-level key -> the registered names it accepts
MOVED_KEYS: dict[str, str] = {}  # a removed dotted key -> what to write instead (register_moved_key)
SECTION_PROVIDERS = ("teamrl.algorithms",)  # packages that register their sections when imported


def register_section(name: str, cls: type) -> type:
    """Add the top-level config section ``name`` (a dataclass of ``option`` fields, validated like the rest)."""
    if name in {f.name for f in dataclasses.fields(Config)}:
        raise ConfigError(f"config section {name!r}: a built-in key of that name exists")
    SECTIONS[name] = cls
    return cls


def register_check(check: Callable[[Config], None]) -> Callable[[Config], None]:
    """Run ``check(cfg)`` (raising :class:`ConfigError`) in :func:`validate`."""
    CHECKS.append(check)
    return check


def register_choices(key: str, names: Callable[[], list[str]]) -> None:
    """The values top-level ``key`` accepts come from ``names()`` (a registry), not from a fixed list."""
    CHOICES[key] = names


def register_moved_key(old: str, new: str) -> None:
    """A dotted config key that was removed: a config that still gives ``old`` fails in one line, ``old was moved:
    write new`` (``new``: the key, or the keys and values, that say it now). Nothing is moved silently."""
    MOVED_KEYS[old] = new


def _refuse_moved_keys(data: dict[str, Any]) -> None:
    """Fail on the first key of :data:`MOVED_KEYS` that the raw config mapping gives, naming where it went."""
    for old, new in MOVED_KEYS.items():
        *parents, leaf = old.split(".")
        node: Any = data
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            raise ConfigError(f"{old} was moved: write {new}")


def load_section_providers() -> None:
    """Import the modules that add their own config sections (``SECTION_PROVIDERS``)."""
    for module in SECTION_PROVIDERS:
        importlib.import_module(module)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults), apply overrides, validate, and return a :class:`Config`."""
    data: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    for key, value in parse_overrides(overrides or []):
        set_path(data, key, value)
    load_section_providers()
    _refuse_moved_keys(data)
    sections = {name: coerce(data.pop(name), cls, name) for name, cls in SECTIONS.items() if name in data}
    try:
        cfg = build_dataclass(Config, data)
    except ConfigError as e:
        if str(e).endswith("]") and "unknown key; allowed keys are" in str(e):  # name the registered sections too
            raise ConfigError(
                str(e)[: str(e).rindex("[")]
                + str(
                    sorted(
                        [f.name for f in dataclasses.fields(Config) if not f.metadata.get("internal")] + list(SECTIONS)
                    )
                )
            ) from None
        raise
    for name, cls in SECTIONS.items():
        cfg.sections[name] = sections.get(name) or cls()
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Checks that span several fields."""
    if not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\\" in cfg.name:
        raise ConfigError(
            f"name: {cfg.name!r} is not allowed; the run directory is run.dir/name, so give one folder name "
            "without '/' (and not '.' or '..'), e.g. name=lr1e-4"
        )
    hidden = next((c for c in cfg.name if unicodedata.category(c)[0] in "CZ" and c != " "), None)
    if hidden is not None:  # a newline splits the logs' lines, a right-to-left override shows the name reversed
        raise ConfigError(f"name: {cfg.name[:40]!r} holds U+{ord(hidden):04X} ({unicodedata.name(hidden, 'a control')}"
                          "), which a folder name shows otherwise or not at all; use letters, digits, '-', '_', '.'")
    if len(cfg.name.encode()) > MAX_NAME_BYTES:
        raise ConfigError(f"name: {len(cfg.name.encode())} bytes long ({cfg.name[:20]!r}...); the run directory is "
                          f"run.dir/name, and a folder name is at most {MAX_NAME_BYTES} bytes")
    r = cfg.rollout
    samples = r.batch_size * r.group_size
    check_memory(
        f"rollout.batch_size={r.batch_size} x rollout.group_size={r.group_size} x rollout.max_new_tokens="
        f"{r.max_new_tokens}: one step's rollout",
        samples * (BYTES_PER_SAMPLE + r.max_new_tokens * BYTES_PER_TOKEN),
        f"{samples} samples of up to {r.max_new_tokens} tokens, {BYTES_PER_SAMPLE} bytes a sample and "
        f"{BYTES_PER_TOKEN} a token",
        "a product that fits: lower them",
    )
    if cfg.policy.mode == "lora_per_role" and cfg.policy.lora is None:
        raise ConfigError(
            "policy.lora: lora_per_role needs LoRA settings, got null; use mode shared or separate for full weights"
        )
    if cfg.policy.roles:
        if cfg.policy.mode == "shared":
            raise ConfigError("policy.roles: mode shared has one policy for every role; give a role map with "
                              "mode lora_per_role or separate")
        bad = [f"{r}: {p!r}" for r, p in cfg.policy.roles.items() if not isinstance(p, str) or not p.isidentifier()]
        if bad:
            raise ConfigError(f"policy.roles: {bad[0]} is not a policy name; give each role a name such as critic "
                              "(letters, digits, underscores)")
    if cfg.run.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("run.wandb: true needs the wandb package: pip install wandb (then wandb login)")
    dev = cfg.policy.device
    if dev not in ("auto", "cpu", "cuda") and not (dev.startswith("cuda:") and dev[5:].isdigit()):
        raise ConfigError(f"policy.device: {dev!r} is not allowed; choose one of ['auto', 'cpu', 'cuda', 'cuda:N']")
    if dev.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"policy.device: {dev!r}, but torch sees no CUDA GPU (torch {torch.__version__}, "
                              f"CUDA build {torch.version.cuda}); use auto or cpu")
    if (
        cfg.rollout.engine == "http"
        and not cfg.rollout.server_urls
        and not cfg.rollout.server_url.startswith(("http://", "https://"))
    ):
        raise ConfigError(f"rollout.server_url: {cfg.rollout.server_url!r} must start with http:// or https://")
    if cfg.rollout.engine == "http":
        _check_server_urls(cfg.rollout.server_urls)
    if cfg.rollout.engine in ("http", "vllm") and cfg.policy.lora is None:
        # a server holds one model: the full weights of one policy, reloaded after each update (separate models:
        # one server per policy, rollout/policy_routes.py)
        if cfg.rollout.engine == "http" and cfg.rollout.server_dialect == "sglang":
            raise ConfigError("rollout.server_dialect: sglang cannot reload full weights here (policy.lora is null); "
                              "serve with vLLM or teamrl serve, or train LoRA adapters")
    if cfg.rollout.engine == "vllm":
        _check_vllm(cfg)
    for key, names in CHOICES.items():
        allowed = names()
        if getattr(cfg, key) not in allowed:
            raise ConfigError(f"{key}: {getattr(cfg, key)!r} is not allowed; choose one of {allowed}")
    if "name" not in cfg.task:
        raise ConfigError("task.name: missing; name a task, e.g. word_count")
    if not isinstance(cfg.task["name"], str):
        raise ConfigError(
            f"task.name: expected a string (a registered task or package.module:object), got {cfg.task['name']!r}"
        )
    if cfg.train.advantage_scope == "team" and cfg.train.advantage == "max":
        raise ConfigError("train.advantage_scope: team pools a problem's roles, but train.advantage: max compares each "
                          "group with its own greedy reply; use advantage_scope agent or another advantage mode")
    if cfg.workflow.name and cfg.train.advantage == "max":
        raise ConfigError("train.advantage: max (greedy baseline) is not supported with a study workflow; use group")
    for check in CHECKS:
        check(cfg)
    _check_placement(cfg.policy)
    if cfg.train.advantage in ("group", "rloo", "batch", "mean", "none") and cfg.rollout.group_size < 2:
        raise ConfigError(
            f"rollout.group_size: {cfg.rollout.group_size} gives groups of one, whose advantage is 0; must be >= 2 "
            "(or use train.advantage=max)"
        )


def _check_server_urls(urls: list[str]) -> None:
    """``rollout.server_urls``: each an http(s) URL, none twice (two clients of one server would unload each other's
    adapters as an earlier process's)."""
    for i, url in enumerate(urls):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.server_urls[{i}]: {url!r} must start with http:// or https://")
    seen = [u.rstrip("/") for u in urls]
    twice = [u for i, u in enumerate(seen) if u in seen[:i]]
    if twice:
        raise ConfigError(f"rollout.server_urls: {twice[0]!r} is listed twice; list each server once")


def _check_vllm(cfg: Config) -> None:
    """``rollout.vllm`` fits the run before anything starts: the adapters' rank within ``--max-lora-rank``; the
    servers' Ray resources and spread."""
    v = cfg.rollout.vllm
    _check_ray_resources("rollout.vllm.resources", v.resources)
    if v.spread and cfg.policy.placement != "ray":
        raise ConfigError("rollout.vllm.spread: true places the vLLM servers with Ray, one per node; it needs "
                          "policy.placement=ray (or set spread false)")
    if v.max_lora_rank and v.max_lora_rank not in VLLM_LORA_RANKS:
        raise ConfigError(f"rollout.vllm.max_lora_rank: {v.max_lora_rank} is not a rank vLLM takes; choose one of "
                          f"{list(VLLM_LORA_RANKS)} or 0 (policy.lora.r rounded up)")
    r = cfg.policy.lora.r if cfg.policy.lora is not None else 0
    if v.max_lora_rank and r > v.max_lora_rank:
        raise ConfigError(
            f"rollout.vllm.max_lora_rank: {v.max_lora_rank} is smaller than the adapters' rank policy.lora.r="
            f"{r}, so the server would refuse to load them; give at least {r} or 0 (follows policy.lora.r)"
        )
    if r > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"policy.lora.r: {r} is over the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
                          "lower it or use rollout.engine=hf")
    if v.command and not all(isinstance(c, str) and c for c in v.command):
        raise ConfigError(f"rollout.vllm.command: expected a list of non-empty strings, got {v.command!r}")
    bad = [k for k, val in v.env.items() if not isinstance(val, (str, int, float)) or isinstance(val, bool)]
    if bad:
        raise ConfigError(f"rollout.vllm.env.{bad[0]}: expected a string, got {v.env[bad[0]]!r}")


def _check_placement(p: PolicyConfig) -> None:
    """``policy.workers`` / ``policy.resources`` are well formed, and Ray is installed when placement asks for it."""
    if p.placement == "ray":
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("policy.placement: ray needs the ray package: pip install -e \".[ray]\" (or use local)")
    seen: dict[str, str] = {}
    for worker, names in p.workers.items():
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"policy.workers.{worker}: expected a non-empty list of policy names, got {names!r}")
        for n in names:
            if n in seen:
                raise ConfigError(f"policy.workers: policy {n!r} is on workers {seen[n]!r} and {worker!r}; give each "
                                  "policy one worker")
            seen[n] = worker
    for worker, res in p.resources.items():
        _check_ray_resources(f"policy.resources.{worker}", res)
    for worker, ranks in p.ranks.items():
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ConfigError(f"policy.ranks.{worker}: expected a whole number of ranks >= 1, got {ranks!r}")
        if ranks > 1 and p.placement != "ray":
            raise ConfigError(f"policy.ranks.{worker}: {ranks} ranks need policy.placement=ray (each rank is a Ray "
                              f"actor); placement is {p.placement!r}")
        gpus = p.resources.get(worker, {}).get("num_gpus", 0)
        if ranks > 1 and 0 < gpus < 1:
            raise ConfigError(f"policy.resources.{worker}.num_gpus: {gpus} with policy.ranks.{worker}={ranks}: each "
                              "rank needs whole GPUs (NCCL cannot put two ranks of one group on one GPU)")


def _check_ray_resources(key: str, res: Any) -> None:
    """A Ray actor's resources (``policy.resources.<worker>``, ``rollout.vllm.resources``): the keys of
    :data:`WORKER_RESOURCES`, each a number >= 0 (``resources``: custom name -> amount)."""
    if not isinstance(res, dict):
        raise ConfigError(f"{key}: expected a mapping of {list(WORKER_RESOURCES)}, got {res!r}")
    bad = [k for k in res if k not in WORKER_RESOURCES]
    if bad:
        raise ConfigError(f"{key}.{bad[0]}: unknown key; allowed keys are {list(WORKER_RESOURCES)}")
    for k, v in res.items():
        if k == "resources":
            if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                                                  for x in v.values()):
                raise ConfigError(
                    f"{key}.resources: expected a mapping of custom resource name -> amount >= 0, got {v!r}"
                )
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{key}.{k}: expected a number >= 0, got {v!r}")


def config_to_dict(cfg: Any) -> Any:
    """The resolved config as plain data (for ``config.yaml`` in the run directory), registered sections included;
    internal fields (not config keys: ``Config.sections``, ``train.loss.max_completion_length``) left out."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        out = {
            f.name: config_to_dict(getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)
            if not f.metadata.get("internal")
        }
        if isinstance(cfg, Config):
            for name, cls in SECTIONS.items():
                out[name] = config_to_dict(cfg.section(cls))
        return out
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


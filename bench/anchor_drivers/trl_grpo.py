"""Times TRL's GRPOTrainer steps on a workload described by a JSON spec (run inside the TRL venv).

Written for ``bench/anchors.py``; it drives TRL only through its public API (``GRPOTrainer``,
``GRPOConfig``, a ``TrainerCallback`` for the step clock) and imports teamrl solely for the task's
reward function, so that both frameworks score completions with the same code.

Usage: python trl_grpo.py SPEC.json OUT.json
"""

import json
import sys
import tempfile
import time

spec = json.load(open(sys.argv[1]))
import torch  # noqa: E402

torch.set_num_threads(spec["threads"])
sys.path.insert(0, spec["repo"])

import peft  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from teamrl.tasks import make_task  # noqa: E402

task = make_task(spec["task"])
problems = {p.id: p for p in task.problems()}


seen: list[tuple[str, int, float]] = []  # (completion text, its token count, reward), for the sanity check


def reward(completions, problem_id, completion_ids=None, **kwargs):
    """teamrl's reward of each completion."""
    values = [task.reward(problems[pid], text) for pid, text in zip(problem_id, completions)]
    counts = ([len(c) for c in completion_ids] if completion_ids is not None  # else re-tokenise the text
              else [len(tok(text, add_special_tokens=False)["input_ids"]) for text in completions])
    seen.extend(zip(completions, counts, values))
    return values


class StepClock(TrainerCallback):
    """Wall time of each optimizer step, generation included (TRL generates inside the step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)
        if len(self.times) == 1:
            seen.clear()  # the sanity check covers the timed steps


T, G, B = spec["max_new_tokens"], spec["group_size"], spec["problems_per_step"]
rows = [{"prompt": text, "problem_id": pid} for step in spec["iterations"] for pid, text in step]
lora = spec["lora"]
with tempfile.TemporaryDirectory() as out_dir:
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=10_000, disable_tqdm=True, seed=spec["seed"], learning_rate=spec["lr"],
        max_steps=len(spec["iterations"]), per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
        num_generations=G, steps_per_generation=1, num_iterations=1, max_completion_length=T,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, loss_type="dapo", shuffle_dataset=False,
        gradient_checkpointing=False, disable_dropout=True, dataloader_num_workers=0, max_grad_norm=1.0,
        generation_kwargs={"min_new_tokens": T} if spec["fixed_length"] else None,
        model_init_kwargs={"dtype": torch.float32},
    )
    tok = AutoTokenizer.from_pretrained(spec["model_path"])
    clock = StepClock()
    trainer = GRPOTrainer(
        model=spec["model_path"], reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tok, callbacks=[clock],
        peft_config=peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                    target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM"))
    trainer.train()
sanity = {"completions": len(seen), "non_empty": sum(bool(text.strip()) for text, _, _ in seen),
          "mean_tokens": sum(n for _, n, _ in seen) / max(1, len(seen)), "rewards": [r for _, _, r in seen],
          # TRL's loss is masked to the completion tokens (its completion_mask) by construction
          "completion_only_loss": True}
out = {"times": clock.times[1:], "warmup_s": clock.times[0], "sanity": sanity, "threads": torch.get_num_threads(),
       "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                    "peft": peft.__version__},
       "prompt_tokens": [len(tok(text)["input_ids"]) for _, text in spec["iterations"][0]]}
json.dump(out, open(sys.argv[2], "w"))
print(json.dumps(out))

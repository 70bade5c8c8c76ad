"""Times CoMLRL's MAGRPOTrainer on a workload described by a JSON spec (run inside the CoMLRL venv).

Written for ``bench/anchors.py``; it drives CoMLRL only through its public API (``MAGRPOTrainer``,
``MAGRPOConfig``, ``train()``) and imports teamrl solely for the task's reward function, so that
both frameworks score completions with the same code.

The tokenizer's pad token is set to ``<|endoftext|>``: CoMLRL 1.4.3 takes a prompt's length from
the position of its first pad token, and SmolLM2's pad token is ``<|im_end|>`` (= EOS), which every
chat prompt contains; left as it is, CoMLRL treats the prompt and the completion together as the
completion, scores every joint action on an empty string and runs its per-token loss loop over
~540 positions instead of the generated ones (see bench/RESULTS.md, anchor defects). The driver
records what the reward function saw (the sanity check printed beside the timings).

Usage: python comlrl_magrpo.py SPEC.json OUT.json
"""

import json
import sys
import time

spec = json.load(open(sys.argv[1]))
import torch  # noqa: E402

torch.set_num_threads(spec["threads"])
torch.manual_seed(spec["seed"])
sys.path.insert(0, spec["repo"])

import comlrl  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402
from comlrl.trainers import MAGRPOConfig, MAGRPOTrainer  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from teamrl.tasks import make_task  # noqa: E402

task = make_task(spec["task"])
problems = {p.id: p for p in task.problems()}
roles = list(task.roles)


seen: list[tuple[str, float]] = []  # (completion text, reward) of every call, for the sanity check


def reward(*completions, batch_items=None):
    """teamrl's team reward of one joint action (one completion per agent)."""
    problem = problems[batch_items[0]["problem_id"]]
    value = task.rewards(problem, [{r: completions[i][0] for i, r in enumerate(roles)}])[0]
    seen.extend((c[0], value) for c in completions)
    return [value]


tok = AutoTokenizer.from_pretrained(spec["model_path"])
# CoMLRL finds the prompt's end at its first pad token: the pad token must not occur in prompts (SmolLM2's <|im_end|> does).
tok.pad_token = "<|endoftext|>"
prompt_ids = [tok(p)["input_ids"] for it in spec["iterations"] for b in it for p in b["prompts"]]
pad_in_prompts = sum(tok.pad_token_id in ids for ids in prompt_ids)
lora = spec["lora"]
agents = []
for _ in roles:
    base = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    cfg = peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                          target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM")
    agents.append(peft.get_peft_model(base, cfg))
T, G = spec["max_new_tokens"], spec["group_size"]
args = MAGRPOConfig(num_train_epochs=1, agent_learning_rate=spec["lr"], num_agents=len(roles), num_generations=G,
                    max_new_tokens=T, temperature=1.0, top_p=1.0, top_k=0, num_turns=1, eval_interval=0,
                    rollout_buffer_size=spec["problems_per_iteration"], train_batch_size=spec["problems_per_iteration"],
                    early_termination_threshold=None)
formatters = [(lambda item, i=i: item["prompts"][i]) for i in range(len(roles))]
gen_kwargs = {"min_new_tokens": T} if spec["fixed_length"] else {}

# The first iteration of the spec is the warm-up (as on the teamrl side); the others are timed.
iterations = spec["iterations"]
times = []
for it, batch in enumerate(iterations):
    ds = Dataset.from_list([{"problem_id": b["problem_id"], "prompts": b["prompts"]} for b in batch])
    if it == 0:
        trainer = MAGRPOTrainer(agents=agents, num_agents=len(roles), tokenizer=tok, train_dataset=ds, reward_func=reward,
                                formatters=formatters, args=args)
    trainer.train_dataset = ds
    t0 = time.perf_counter()
    trainer.train(**gen_kwargs)
    times.append(time.perf_counter() - t0)
    if it == 0:
        seen.clear()  # the sanity check covers the timed iterations
lengths = [len(tok(text, add_special_tokens=False)["input_ids"]) for text, _ in seen]
sanity = {"completions": len(seen), "non_empty": sum(bool(text.strip()) for text, _ in seen),
          "mean_tokens": sum(lengths) / max(1, len(lengths)), "rewards": [r for _, r in seen][::len(roles)],
          "prompts_with_pad": pad_in_prompts, "pad_token": tok.pad_token,
          # CoMLRL's loss starts at its prompt length (the first pad token): completion-only iff no prompt holds one
          "completion_only_loss": pad_in_prompts == 0}
out = {"times": times[1:], "warmup_s": times[0], "sanity": sanity, "threads": torch.get_num_threads(),
       "versions": {"comlrl": getattr(comlrl, "__version__", "?"), "torch": torch.__version__,
                    "transformers": transformers.__version__, "peft": peft.__version__},
       "prompt_tokens": [[len(tok(p)["input_ids"]) for p in b["prompts"]] for b in spec["iterations"][0]]}
json.dump(out, open(sys.argv[2], "w"))
print(json.dumps(out))

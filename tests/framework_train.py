"""Train an agent-framework team 2 steps through the gateway, with some answers scripted as tool calls.

Run as ``python tests/framework_train.py PLUGIN CONFIG RUN_DIR RULES_JSON [overrides...]`` (tests/test_agent_frameworks.py).

A random tiny model never writes a valid tool call, so the engine is wrapped (here, for the test only): a request
of a policy whose prompt matches a rule gets the rule's text (a Hermes ``<tool_call>`` block and the end-of-sequence
token) for every other such request, in place of what the model sampled; the others keep the model's own sample.
Everything after the engine is the real path: the gateway parses the text into ``tool_calls``, the framework runs the
tool or the hand-off, and the trainer trains every recorded token (the scripted ones as if sampled, with log-prob 0:
the importance correction is off at max_staleness 0, so the loss recomputes its own). Writes ``trace.json``: the
engine's completions, the recorded samples and the gateway's counts.
"""
import json
import sys

from teamrl.api import load_plugin, register_reward
from teamrl.core.config import load_config
from teamrl.rollout.engine import Completion
from teamrl.trainer.trainer import Trainer

plugin, config, run_dir, rules = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
load_plugin(plugin)


@register_reward("token_parity")  # differs between samples of a random model, so advantages (and adapters) move
def token_parity(sample, outcome):
    return (sum(sample.completion_ids) % 7) / 6


cfg = load_config(config, sys.argv[5:] + [f"run.dir={run_dir}"])
trainer = Trainer(cfg)
tok = trainer.engine.tokenizer
engine_out, recorded, seen = [], [], {}
generate_many = trainer.engine.generate_many


def scripting_engine(calls):
    out = generate_many(calls)
    for (policy, requests, _), per_policy in zip(calls, out):
        for request, completions in zip(requests, per_policy):
            prompt = tok.decode(request.prompt_ids)
            for rule in rules:
                if rule["policy"] == policy and rule["when"] in prompt and rule.get("unless", "\0") not in prompt:
                    for j, c in enumerate(completions):
                        seen[policy] = seen.get(policy, 0) + 1
                        if seen[policy] % 2:
                            ids = tok.encode(rule["text"], add_special_tokens=False) + [tok.eos_token_id]
                            completions[j] = Completion(ids, [0.0] * len(ids), rule["text"], "eos")
                    break
            engine_out.extend(c.token_ids for c in completions)
    return out


trainer.engine.generate_many = scripting_engine
rollout = trainer._rollout


def recording_rollout(*args):
    samples = rollout(*args)
    recorded.extend({"role": s.role, "policy": s.policy, "ids": s.completion_ids, "tool_calls": s.tags.get("tool_calls"),
                     "errors": s.tags.get("tool_call_errors"), "prefix_break": s.tags.get("prefix_break"),
                     "tool_result": "<tool_response>\n42" in (s.prompt_text or "")}
                    for s in samples)
    return samples


trainer._rollout = recording_rollout
trainer.train()
from teamrl.rollout.gateway import _GATEWAYS  # noqa: E402  (the run's gateway: its counts)

stats = [vars(gw.stats) for gw in _GATEWAYS.values()]
json.dump({"engine": engine_out, "recorded": recorded, "gateway": stats}, open(f"{run_dir}/trace.json", "w"))

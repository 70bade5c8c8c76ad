"""The public extension API: registries, --plugin, package.module:object references, the role -> policy map,
and the user-workflow example (examples/proposer_critic_judge.py) trained and evaluated through the CLI.

Nothing here registers into the library's registries in this process: plugins are loaded by a
``teamrl`` subprocess, and registry behaviour is checked on fresh :class:`Registry` instances."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from teamrl.cli import main
from teamrl.core import registry as registry_module
from teamrl.core.config import ConfigError, LoraConfig, load_config
from teamrl.core.registry import Registry, load_plugin
from teamrl.policies.router import PolicyRouter

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "proposer_critic_judge.py"
EXAMPLE_YAML = ROOT / "examples" / "proposer_critic_judge.yaml"
TEAMRL = Path(sys.executable).parent / "teamrl"
LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])

# A reward that differs between samples of a random model (the example's correctness is always 0 there),
# so that advantages, and hence the adapters, move.
VARIED_REWARD = '''
from teamrl.api import register_reward

@register_reward("token_parity")
def token_parity(sample, outcome):
    return (sum(sample.completion_ids) % 7) / 6
'''


def _teamrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([str(TEAMRL), *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_example_uses_only_the_public_api_in_at_most_40_lines():
    source = EXAMPLE.read_text()
    assert sum(1 for line in source.splitlines() if line.strip()) <= 40
    modules = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in modules if m.startswith("teamrl")} == {"teamrl.api"}


@pytest.mark.parametrize("policy, expected", [
    (["policy.mode=shared"], {"shared"}),
    (["policy.mode=lora_per_role"], {"proposer", "critic", "judge"}),
    (["policy.mode=lora_per_role", "policy.roles={proposer: proposer, critic: reviewer, judge: reviewer}"],
     {"proposer", "reviewer"}),
], ids=["shared", "adapter_per_role", "role_map"])
def test_example_trains_and_evaluates_through_the_cli_with_a_plugin(tmp_path, policy, expected):
    reward_plugin = tmp_path / "my_reward.py"
    reward_plugin.write_text(VARIED_REWARD)
    done = _teamrl("train", str(EXAMPLE_YAML), "--plugin", str(EXAMPLE), "--plugin", str(reward_plugin),
                   "model=tiny-random", "train.steps=2", "rollout.group_size=6", "rollout.batch_size=1",
                   "rollout.max_new_tokens=6", "workflow.reward=token_parity", "policy.device=cpu", "train.lr=0.01",
                   f"run.dir={tmp_path}", "name=pcj", "run.progress=false", "run.tensorboard=false", *policy)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "pcj" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert {k.split("/", 1)[1] for k in r if k.startswith("grad_norm/")} == expected
    ckpt = sorted((tmp_path / "pcj" / "checkpoints").iterdir())[-1]
    assert {p.name for p in ckpt.glob("policy_*.pt")} == {f"policy_{n}.pt" for n in expected}
    for name in expected:  # LoRA B starts at zero: a non-zero B is an adapter that moved
        weights = torch.load(ckpt / f"policy_{name}.pt")
        moved = [k for k, v in weights.items() if "lora_B" in k and v.abs().max() > 0]
        assert moved, f"adapter {name!r} did not move"
    # teamrl eval of the trained run: the trained team, the same team untrained and the single-agent baseline, paired,
    # on problems the run did not train on (the example's task draws another set with another task.seed)
    evaluated = _teamrl("eval", "--checkpoint", str(tmp_path / "pcj"), "--plugin", str(EXAMPLE), "--plugin",
                        str(reward_plugin), "--limit", "2", "task.seed=1")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in evaluated.stdout.splitlines() if line.startswith("| ")]
    column = table[0].index("problems")  # the user workflow's rows and the single baseline's differ in measure: a column says so
    rows = {cells[0]: cells for cells in table[1:]}
    for method in ("team", "untrained", "single"):
        assert method in rows and rows[method][column] == "2", evaluated.stdout
    assert "team - untrained:" in evaluated.stdout and "paired over the same 2 problems" in evaluated.stdout


def test_unregistered_names_are_one_line_errors_that_name_what_is_registered(capsys):
    for override, registered in (("task.name=nope", "'word_count'"), ("workflow.name=nope", "'voting'"),
                                 ("workflow.reward=nope", "'per_role'")):
        extra = ["task.name=math.solve", "task.source=generated_easy", "task.num_problems=20", "task.test_size=4"] \
            if override.startswith("workflow") else []
        extra += ["workflow.name=single"] if override.startswith("workflow.reward") else []
        assert main(["config", *extra, override]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "nope" in err and registered in err, err


def test_a_plugin_file_registers_for_the_cli_and_a_missing_one_is_an_input_error(tmp_path):
    plugin = tmp_path / "team.py"
    plugin.write_text(VARIED_REWARD)
    ok = _teamrl("config", "--plugin", str(plugin), "task.name=math.solve", "task.source=generated_easy",
                 "task.num_problems=20", "task.test_size=4", "workflow.name=single", "workflow.reward=token_parity")
    assert ok.returncode == 0, ok.stderr
    assert "reward: token_parity" in ok.stdout
    missing = _teamrl("config", "--plugin", str(tmp_path / "absent.py"))
    assert missing.returncode == 2 and "absent.py" in missing.stderr and missing.stderr.count("\n") == 1


def test_config_values_may_name_package_module_object(capsys):
    assert main(["config", "task.name=teamrl.tasks.word_count:WordCountTask"]) == 0
    assert main(["config", "task.name=teamrl.tasks.word_count:Nothing"]) == 2
    assert "has no 'Nothing'" in capsys.readouterr().err


def test_a_workflows_own_options_are_validated_like_task_options(capsys):
    base = ["config", "task.name=math.solve", "task.source=generated_easy", "task.num_problems=20", "task.test_size=4",
            "workflow.name=tests.extension_fixtures:ECHO"]
    assert main([*base, "workflow.options.repeats=2"]) == 0
    assert main([*base, "workflow.options.bogus=1"]) == 2
    assert "workflow.options.bogus: unknown key; allowed keys are ['prefix', 'repeats']" in capsys.readouterr().err
    assert main([*base, "workflow.options.repeats=two"]) == 2
    assert "workflow.options.repeats: expected an integer" in capsys.readouterr().err
    assert main(["config", "task.name=math.solve", "task.source=generated_easy", "task.num_problems=20",
                 "task.test_size=4", "workflow.name=voting", "workflow.options.repeats=2"]) == 2
    assert "workflow.options.repeats: unknown key; allowed keys are ['max_iterations', 'max_subtasks', 'num_generators']" \
        in capsys.readouterr().err
    assert main(["config", "task.name=math.solve", "task.source=generated_easy", "task.num_problems=20",
                 "task.test_size=4", "workflow.name=proposer_critic_judge", "--plugin", "examples/proposer_critic_judge.py",
                 "workflow.options.repeats=2"]) == 2
    assert "declares no options of its own" in capsys.readouterr().err


def test_the_study_workflows_old_top_level_options_fail_naming_workflow_options():
    with pytest.raises(ConfigError, match=r"^workflow.num_generators was moved: write workflow.options.num_generators$"):
        load_config(None, ["task.name=math.solve", "workflow.name=voting", "workflow.num_generators=4"])
    with pytest.raises(ConfigError, match=r"^workflow.num_generators was moved"):  # also when the new place is given
        load_config(None, ["workflow.name=voting", "workflow.num_generators=4", "workflow.options.num_generators=5"])


def test_registry_decorator_duplicates_and_unknown_names():
    reg: Registry[type] = Registry("widget")

    @reg.register("gear")
    class Gear:
        pass

    assert reg.get_entry("gear", "widget.name") is Gear
    reg.register("gear", Gear)  # the same object again is fine (a module imported twice)
    with pytest.raises(ConfigError, match="widget 'gear' is already registered"):
        reg.register("gear", object())
    with pytest.raises(ConfigError, match=r"widget.name: 'cog' is not a registered widget; registered: \['gear'\]"):
        reg.get_entry("cog", "widget.name")
    with pytest.raises(ConfigError, match="must be a non-empty string without ':'"):
        reg.register("a:b", Gear)


def test_entry_points_are_loaded_when_a_lookup_misses(monkeypatch):
    reg: Registry[str] = Registry("widget")

    class EntryPoint:
        name = "installed_team"

        def load(self):
            reg.register("from_package", "installed")

    monkeypatch.setattr(registry_module, "_entry_points_loaded", False)
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [EntryPoint()] if group == "teamrl.plugins" else [])
    assert reg.get_entry("from_package", "widget.name") == "installed"


def test_a_reward_that_returns_no_number_is_an_input_error_naming_it():
    from teamrl.algorithms.grpo import assign_rewards
    from teamrl.core.config import InputError
    from teamrl.core.sample import Sample
    from teamrl.workflows import EpisodeOutcome

    sample = Sample(role="judge", policy="shared", problem_id="p", prompt_ids=[1], completion_ids=[2], sampling_logprobs=[0.0])
    reference = "tests.extension_fixtures:forgot_return"
    with pytest.raises(InputError, match=f"workflow.reward '{reference}': returned None for a 'judge' sample"):
        assign_rewards([sample], EpisodeOutcome("", None, False), reference)


def test_load_plugin_rejects_a_file_that_is_not_python(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="notes.txt"):
        load_plugin(tmp_path / "notes.txt")


def test_explicit_role_map_routes_each_listed_role_and_the_default_is_one_policy_per_declared_role():
    default = PolicyRouter("lora_per_role", ["critic", "critic2"], "tiny-random", LORA, lr=1e-2)
    assert sorted(default.policies) == ["critic", "critic2"]  # documented default: a declared critic2 is its own role
    explicit = PolicyRouter("lora_per_role", ["critic", "critic2", "judge"], "tiny-random", LORA, lr=1e-2,
                            role_map={"critic": "critic", "critic2": "second", "judge": "second"})
    assert sorted(explicit.policies) == ["critic", "second"]
    assert [explicit.policy_name(r) for r in ("critic", "critic2", "judge")] == ["critic", "second", "second"]
    with pytest.raises(ConfigError, match=r"policy.roles: roles \['critic2'\] have no policy"):
        PolicyRouter("lora_per_role", ["critic", "critic2"], "tiny-random", LORA, lr=1e-2, role_map={"critic": "critic"})


def test_role_map_needs_a_mode_with_several_policies_and_valid_names():
    with pytest.raises(ConfigError, match="mode shared has one policy"):
        load_config(None, ["policy.roles={a: a}"])
    with pytest.raises(ConfigError, match="is not a policy name"):
        load_config(None, ["policy.mode=lora_per_role", "policy.roles={a: 'x y'}"])


def test_the_same_plugin_file_twice_in_one_process_registers_once(tmp_path, capsys):
    """A second CLI run in the same process (a notebook, a test, a script calling main twice) with the same --plugin
    file: its registrations stand; before, the second import registered its names again and failed."""
    plugin = tmp_path / "twice.py"
    plugin.write_text("from teamrl.api import register_reward\n\n\n@register_reward('twice_reward')\n"
                      "def twice_reward(sample, outcome):\n    return 0.0\n")
    args = ["config", "--plugin", str(plugin), "workflow.reward=twice_reward"]
    assert main(args) == 0 and main(args) == 0, capsys.readouterr().err

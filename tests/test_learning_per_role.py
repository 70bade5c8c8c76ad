"""The learning grid's AT-GRPO per-role arm: its own (per-role) warm start, the swapped-policies evaluation
of the same trained run as a row of its own, and the cache keys of the arms that were there before it."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from tests.test_learning_bench import _learning

PER_ROLE = "AT-GRPO, tree grouping, per-role policies, warm start"


def _old_fingerprint(learning, comp, index: int, eval_problems: int, quick: bool, level) -> str:
    """The cell fingerprint as it was built before the per-role arm (the cached cells hold these)."""
    arm = comp.arms[index]
    import learning_cache  # memory settings (train.micro_batch_size) never were part of what decides a cell

    overrides = [o for o in learning._overrides(comp, arm, quick, False, level) if not o.startswith(learning_cache.MEMORY_SETTINGS)]
    what = {"config": comp.config, "overrides": overrides, "eval": eval_problems,
            "rl": arm.rl, "warm": [arm.warm_start, list(comp.warm_roles), comp.warm_problems, comp.warm_epochs, learning.WARM_LR]
            if arm.warm_start else None}
    if arm.method:
        what["method"] = arm.method
    if arm.seed_free:
        what["seed_free"] = True
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def test_the_per_role_arms_come_last_and_the_earlier_arms_keep_label_index_and_cache_key():
    learning = _learning()
    at = next(c for c in learning.comparisons() if c.key == "at_grpo")
    assert [a.label for a in at.arms] == ["untrained team", "warm start only", "single-agent GRPO (planner alone), warm start",
                                          "AT-GRPO, trajectory grouping, warm start", "AT-GRPO, tree grouping, warm start", PER_ROLE,
                                          "warm start only, per-role policies", "warm start only, planner alone"]
    arm = at.arms[5]
    alone = at.arms[6]  # its warm start alone: the per-role RL arm's own effect
    assert alone.overrides == ("policy.mode=lora_per_role",) and alone.warm_start and not alone.rl
    assert arm.overrides == ("at_grpo.grouping=tree", "policy.mode=lora_per_role") and arm.warm_start and arm.rl
    assert arm.also_eval == ("swapped",)
    # calibration still scores the shared tree-grouping arm (bench/calibration.json keeps its levels)
    assert at.arms[at.calibration_arm].label == "AT-GRPO, tree grouping, warm start"
    for comp in learning.comparisons():
        for i, a in enumerate(comp.arms):
            for quick in (False, True):
                for level in (None, *comp.levels):
                    fp = learning.cell_fingerprint(comp, i, 48, quick, level)
                    if a.also_eval or (a.warm_start and any(o.startswith("policy.") for o in a.overrides)):  # its own warm start or
                        # the swapped scores: a key of its own
                        assert fp != _old_fingerprint(learning, comp, i, 48, quick, level)
                    else:
                        assert fp == _old_fingerprint(learning, comp, i, 48, quick, level), (comp.key, a.label, quick, level)


def test_an_arm_that_sets_its_policy_gets_its_own_warm_start(tmp_path, monkeypatch):
    """The same demonstrations, roles, problems and epochs, on the arm's policy mode, in a directory of its own;
    the shared warm start (no policy overrides) keeps its name."""
    import teamrl.trainer.sft as sft

    learning = _learning()
    at = next(c for c in learning.comparisons() if c.key == "at_grpo")
    seen = {}

    def fake_warm_start(cfg, demos, epochs, batch_size, lr, progress):
        seen[cfg.name] = (cfg.policy.mode, sorted({d.role for d in demos}), len(demos), epochs, lr)
        (tmp_path / cfg.name).mkdir()
    monkeypatch.setattr(sft, "warm_start", fake_warm_start)
    shared, _ = learning.shared_warm_start(at, 0, tmp_path, True, False, None, at.arms[4])
    again, _ = learning.shared_warm_start(at, 0, tmp_path, True, False, None)  # no arm: the comparison's own
    per_role, _ = learning.shared_warm_start(at, 0, tmp_path, True, False, None, at.arms[5])
    assert shared == again and shared.name == "at_grpo-warm-seed0"
    assert per_role.name == "at_grpo-warm-seed0-lora-per-role"
    assert seen["at_grpo-warm-seed0"][0] == "shared" and seen["at_grpo-warm-seed0-lora-per-role"][0] == "lora_per_role"
    assert seen["at_grpo-warm-seed0"][1:] == seen["at_grpo-warm-seed0-lora-per-role"][1:]
    assert seen["at_grpo-warm-seed0"][1] == ["planner", "tool"]  # both roles: the tool's program fits in 256 tokens


def _result(learning, label: str, scores: list[float], seed: int = 0, swapped: list[float] | None = None):
    r = learning.ArmResult(label, seeds=[seed], scores=[sum(scores) / len(scores)], wall=[2.0], tokens=[10.0], episodes=8,
                           problem_ids=[["g1", "g2", "g3"]], problem_scores=[scores], signal=[None], signal_groups=[[0, 0]],
                           role_grad_norms=[{}])
    if swapped is not None:
        sw = learning.ArmResult(label, seeds=[seed], scores=[sum(swapped) / len(swapped)], wall=[1.0], tokens=[10.0],
                                problem_ids=[["g1", "g2", "g3"]], problem_scores=[swapped], success=[0.0], signal=[None],
                                signal_groups=[[0, 0]], role_grad_norms=[{}])
        r.also.append({"swapped": dataclasses.asdict(sw)})
    return r


def test_the_swapped_scores_are_a_row_of_their_own_on_the_page_and_in_the_json():
    """Paired vs the untrained team and the warm start alone like any arm, and team - swapped (the
    specialisation check) under the table and in learning_results.json."""
    learning = _learning()
    at = next(c for c in learning.comparisons() if c.key == "at_grpo")
    scores = {"untrained team": [0.0] * 3, "warm start only": [0.5, 0.0, 0.0], PER_ROLE: [1.0, 1.0, 0.5],
              "warm start only, per-role policies": [0.5, 0.5, 0.0]}
    results = [_result(learning, a.label, scores.get(a.label, [0.0] * 3), swapped=[0.5, 0.0, 0.5] if a.also_eval else None)
               for a in at.arms]
    page = learning.render(at, results, [0], 3, None)
    lines = page.splitlines()
    at_row = next(i for i, line in enumerate(lines) if line.startswith(f"| {PER_ROLE} |"))
    swapped = lines[at_row + 1]
    assert swapped.startswith(f"| {PER_ROLE}, swapped policies | 0.333 | 0.000 |"), swapped
    assert "| s0: +0.333 +/- 0.167 |" in swapped  # vs the untrained team
    assert swapped.rstrip().endswith("| s0: +0.000 +/- 0.289 |")  # vs its own (per-role) warm start alone
    assert (f"Specialisation check (the team's score minus the same run's with each role on the next role's policy, "
            f"paired per seed): {PER_ROLE}: s0: +0.500 +/- 0.289.") in page
    summary = learning.results_json([at], {at.key: results}, {at.key: None}, {at.key: 3}, "test")
    arms = {a["arm"]: a for a in summary["sections"][0]["arms"]}
    assert list(arms)[-4:] == [PER_ROLE, f"{PER_ROLE}, swapped policies", "warm start only, per-role policies",
                               "warm start only, planner alone"]
    row = arms[f"{PER_ROLE}, swapped policies"]
    assert row["of_arm"] == PER_ROLE and row["method"] == "swapped" and abs(row["mean"] - 1 / 3) < 1e-12
    assert row["paired_vs_untrained"]["0"]["problems"] == 3 and "paired_vs_warm_start" in row
    assert abs(row["paired_team_minus_method"]["0"]["difference"] - 0.5) < 1e-12
    assert "of_arm" not in arms[PER_ROLE]
    # not run yet: the row says so too
    results[5] = learning.ArmResult(PER_ROLE)
    assert f"| {PER_ROLE}, swapped policies | not run yet |" in learning.render(at, results, [0], 3, None)


def test_quick_per_role_arm_trains_once_scores_team_and_swapped_and_the_cache_renders_the_row(tmp_path, monkeypatch):
    """--quick on the tiny model: the per-role arm is evaluated by team and swapped in one evaluation (no second
    training), its cell holds the swapped per-problem scores, and --render-only makes the row from the cell."""
    import teamrl.trainer.evaluate as ev

    learning = _learning()
    real, methods = ev.evaluate, []
    monkeypatch.setattr(ev, "evaluate", lambda cfg, m, *a, **k: methods.append((cfg.policy.mode, tuple(m))) or real(cfg, m, *a, **k))
    out, cells = tmp_path / "a" / "LEARNING.md", tmp_path / "cells"
    args = ["--quick", "--only", "at_grpo", "--out", str(out), "--cells", str(cells)]
    assert learning.main(args) == 0
    assert methods.count(("lora_per_role", ("team", "swapped"))) == 1  # one evaluation scores both
    assert ("lora_per_role", ("team",)) in methods  # the per-role warm start alone
    assert methods[-1] == ("shared", ("team",))  # last, the team's warm start scored planner-alone
    cell = json.loads((cells / "at_grpo" / "at-grpo-tree-grouping-per-role-policies-warm-start-seed0.json").read_text())
    (extra,) = cell["result"]["also"]
    assert len(extra["swapped"]["problem_scores"][0]) == 2 and extra["swapped"]["seeds"] == [0]
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| {PER_ROLE}, swapped policies |"))
    assert 0.0 <= float(row.split("|")[2]) <= 1.0, row
    summary = json.loads((out.parent / "learning_results.json").read_text())

    def no_run(*a, **k):
        raise AssertionError("a cached run ran again")
    monkeypatch.setattr(learning, "run_arm", no_run)
    out2 = tmp_path / "b" / "LEARNING.md"
    assert learning.main([*args[:3], "--out", str(out2), "--cells", str(cells), "--render-only"]) == 0
    assert row in out2.read_text().splitlines() and "Specialisation check" in out2.read_text()
    assert json.loads((out2.parent / "learning_results.json").read_text())["sections"] == summary["sections"]

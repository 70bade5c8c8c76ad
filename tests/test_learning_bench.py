"""``make learn`` / ``teamrl bench --learning``: the --quick smoke run of the whole grid on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _learning():
    spec = importlib.util.spec_from_file_location("learning", REPO / "bench" / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["learning"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_quick_learning_run_writes_every_table_and_curve(tmp_path):
    learning = _learning()
    out = tmp_path / "LEARNING.md"
    committed = sorted(learning.CELLS.rglob("*")) if learning.CELLS.exists() else []
    assert learning.main(["--quick", "--out", str(out)]) == 0
    # --quick caches its runs in a temporary folder, never in the committed cache
    assert (sorted(learning.CELLS.rglob("*")) if learning.CELLS.exists() else []) == committed
    page = out.read_text()
    assert "--quick smoke run" in page and re.search(r"wall time \d+ s", page)
    for comp in learning.comparisons():
        assert f"### {comp.title}" in page
        for arm in comp.arms:
            row = next(line for line in page.splitlines() if line.startswith(f"| {arm.label} |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert 0.0 <= float(cells[1]) <= 1.0, row  # held-out normalised return of the one seed
            assert (cells[5] != "-") == arm.rl, row  # RL arms sampled episodes; the others none
            for method in arm.also_eval:  # the same trained run scored by another method (swapped): a row of its own
                also = next(line for line in page.splitlines() if line.startswith(f"| {arm.label}, {learning.ALSO_LABELS[method]} |"))
                assert 0.0 <= float(also.split("|")[2]) <= 1.0, also
        png = tmp_path / f"LEARNING_{comp.key}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and f"]({png.name})" in page
    for section in page.split("### ")[1:]:  # the study flags arms whose held-out accuracy fell under the untrained team's
        assert ("Accuracy cliffs (held-out accuracy" in section) == section.startswith("Workflow study"), section
        # ... and gives each trained arm's peak and final training accuracy and its gradient norm per role
        assert ("| arm | training peak (step), per seed |" in section) == section.startswith("Workflow study"), section
        if section.startswith("Workflow study"):
            assert re.search(r"\| IP \(LoRA per role\)[^|]* \| .* \| [a-z_]+ \d+\.\d\d", section), section
    # equal budgets: every RL arm of a comparison sampled the same number of episodes
    for section in page.split("### ")[1:]:
        table = section.split("| arm | held-out")[1].split("\n\n")[0]  # the arms' table, not the tables under it
        episodes = {line.split("|")[6].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line
                    and not line.startswith("| arm")} - {"-"}
        assert len(episodes) == 1, section


def test_bench_learning_dispatch_and_a_bad_comparison_name(capsys):
    from teamrl.cli import main

    assert main(["bench", "--learning", "--quick", "--only", "nope"]) == 2
    assert "--only 'nope' is not a comparison; choose from ['magrpo'" in capsys.readouterr().err


def test_parallel_runs_in_child_processes_fill_the_same_table(tmp_path):
    """``--jobs 2``: each (arm, seed) runs in its own process at one thread; their results come back into the table."""
    learning = _learning()
    out = tmp_path / "LEARNING.md"
    # the untrained team (run once for both seeds) and MAGRPO (one run per seed): 3 child processes
    assert learning.main(["--quick", "--jobs", "2", "--only", "magrpo", "--seeds", "2", "--arms", "0,3",
                          "--out", str(out)]) == 0
    page = out.read_text()
    for i, arm in enumerate(next(c for c in learning.comparisons() if c.key == "magrpo").arms):
        row = next(line for line in page.splitlines() if line.startswith(f"| {arm.label} |"))
        score = row.split("|")[2].strip()
        if i in (0, 3):
            assert re.fullmatch(r"\d\.\d{3} \(\d\.\d{3}\.\.\d\.\d{3}\)", score), row  # mean (min..max) over 2 seeds
        else:
            assert score == "not run yet", row
    assert learning.main(["--quick", "--jobs", "0", "--only", "magrpo", "--out", str(out)]) == 2


def test_a_stopped_run_leaves_the_runs_it_finished(tmp_path, monkeypatch):
    """The page is written after every run, so a grid stopped part-way keeps what it measured."""
    import pytest

    learning = _learning()
    real, calls = learning.run_arm, []

    def stops_at_the_second_run(*args, **kwargs):
        calls.append(1)
        if len(calls) >= 2:  # stopped from the second run on (the pool still hands it the runs queued)
            raise RuntimeError("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(learning, "run_arm", stops_at_the_second_run)
    out, cells = tmp_path / "LEARNING.md", tmp_path / "cells"
    with pytest.raises(RuntimeError, match="stopped"):
        learning.main(["--quick", "--only", "magrpo", "--out", str(out), "--cells", str(cells)])
    page = out.read_text()
    # the untrained team runs first, then MAGRPO of the same seed (the prompt baselines after every seed)
    assert "partial: 1 of 6 runs finished so far" in page
    assert re.search(r"^\| untrained team \| \d\.\d{3} \|", page, re.M) and "| MAGRPO | not run yet |" in page
    # resumed on the same cache: only the run that was missing runs
    calls.clear()
    monkeypatch.setattr(learning, "run_arm", lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1])
    assert learning.main(["--quick", "--only", "magrpo", "--out", str(out), "--cells", str(cells)]) == 0
    assert len(calls) == 5 and "partial" not in out.read_text() and "1 runs read from the cache" in out.read_text()


def test_held_out_cliffs_pair_each_arm_with_the_untrained_team_of_its_seed():
    learning = _learning()
    untrained = learning.ArmResult("untrained team", seeds=[1, 0], success=[0.5, 0.2])
    steady = learning.ArmResult("SP", seeds=[0, 1], success=[0.2, 0.45])  # 5 points under on seed 1: no cliff
    fell = learning.ArmResult("IP", seeds=[0, 1], success=[0.3, 0.25])  # seed 1: 25 points under
    line = learning.held_out_cliffs([untrained, steady, fell])
    assert line.endswith("IP (seed 1: 25% vs 50%).") and "SP" not in line
    assert learning.held_out_cliffs([untrained, steady]).endswith(": none.")


def test_study_dynamics_give_peak_final_training_cliffs_and_per_role_gradient_norms():
    """The workflow study's paper reports peak and final accuracy, falls from a peak and gradient norms per role
    (here over 3-step windows of the training curve: one step of 8 episodes is too noisy to call a peak)."""
    import pytest

    learning = _learning()
    untrained = learning.ArmResult("untrained team", seeds=[0, 1])
    # seed 0 climbs to a 3-step mean of 0.5 (steps 2-4) and falls to 0 (a 50-point cliff); seed 1 stays at 0.25
    sp = learning.ArmResult("SP", seeds=[0, 1], curves=[[0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0], [0.25] * 6],
                            role_grad_norms=[{"generator": 2.0, "aggregator": 1.0}, {"generator": 4.0, "aggregator": 3.0}])
    untrained_row, sp_row = learning.study_dynamics([untrained, sp])
    assert untrained_row is None
    assert sp_row["peak"] == [0.5, 0.25] and sp_row["peak_step"] == [4, 3]
    assert sp_row["final"] == [0.0, 0.25] and sp_row["fell_from_peak"] == [0.5, 0.0]
    assert sp_row["role_grad_norm"] == {"aggregator": 2.0, "generator": 3.0}  # mean over seeds
    table = learning.render_study_dynamics([untrained, sp])
    assert "| SP | s0: 0.500 (step 4); s1: 0.250 (step 3) | s0: 0.000; s1: 0.250 | s0: -50 points |" in table
    assert "aggregator 2.00, generator 3.00" in table
    steady = learning.ArmResult("IP", seeds=[0], curves=[[0.1, 0.2]], role_grad_norms=[{}])  # shorter than a window
    row = learning.study_dynamics([untrained, steady])[1]
    assert row["peak"] == row["final"] == pytest.approx([0.15]) and row["peak_step"] == [2] and row["role_grad_norm"] == {}
    assert "| IP | s0: 0.150 (step 2) | s0: 0.150 | none | - |" in learning.render_study_dynamics([untrained, steady])


def test_the_cache_resumes_the_grid_and_renders_the_page_and_json_alone(tmp_path, monkeypatch):
    """Each finished (comparison, arm, seed) is a JSON cell; a second run reuses every cell of the same settings,
    --render-only rewrites the page and learning_results.json from the cells alone, and a cell of other
    settings (its fingerprint) is run again."""
    import json

    learning = _learning()
    out, cells = tmp_path / "a" / "LEARNING.md", tmp_path / "cells"
    args = ["--quick", "--only", "magrpo", "--out", str(out), "--cells", str(cells)]
    real_run = learning.run_arm
    import teamrl.trainer.evaluate as ev

    real_evaluate, methods = ev.evaluate, []
    monkeypatch.setattr(ev, "evaluate", lambda cfg, m, *a, **k: methods.append(tuple(m)) or real_evaluate(cfg, m, *a, **k))
    assert learning.main(args) == 0
    # each arm scored by its own method: the prompt baselines through their workflows on the base weights
    assert methods == [("untrained",), ("team",), ("team",), ("team",), ("sequential",), ("discussion",)]
    files = sorted(p.name for p in (cells / "magrpo").iterdir())
    assert files == ["discussion-prompt-baseline-untrained-every-seed.json", "magrpo-4-papers-per-step-20-steps-seed0.json",
                     "magrpo-4-papers-per-step-seed0.json", "magrpo-seed0.json",
                     "sequential-prompt-baseline-untrained-every-seed.json", "untrained-team-every-seed.json"]
    summary = json.loads((out.parent / "learning_results.json").read_text())
    (section,) = summary["sections"]
    untrained, sequential, discussion, magrpo, *_ = section["arms"]
    assert [a["arm"] for a in section["arms"]][1:3] == ["sequential (prompt baseline, untrained)",
                                                        "discussion (prompt baseline, untrained)"]
    assert sequential["evaluated_once"] and not magrpo["evaluated_once"] and set(discussion["paired_vs_untrained"]) == {"0"}
    assert section["key"] == "magrpo" and section["eval_problems"] == 2
    assert untrained["seeds"] == [0] and untrained["held_out_problems"] == [2] and untrained["paired_vs_untrained"] == {}
    paired = magrpo["paired_vs_untrained"]["0"]
    assert paired["problems"] == 2 and paired["stderr"] >= 0 and magrpo["signal_groups"] == [2]  # one group per agent

    def no_run(*a, **k):
        raise AssertionError("a cached run ran again")
    monkeypatch.setattr(learning, "run_arm", no_run)
    page = out.read_text()
    out2 = tmp_path / "b" / "LEARNING.md"
    assert learning.main([*args[:-4], "--out", str(out2), "--cells", str(cells), "--render-only"]) == 0
    again = out2.read_text()
    assert "6 runs read from the cache" in again and "partial" not in again
    table = [line for line in page.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1:5] for line in table] == [line.split("|")[1:5] for line in again.splitlines() if line.startswith("| ")]
    assert json.loads((out2.parent / "learning_results.json").read_text())["sections"] == summary["sections"]
    # another setting is another cell: the stale one runs again
    cell = cells / "magrpo" / "magrpo-seed0.json"
    stale = json.loads(cell.read_text())
    cell.write_text(json.dumps({**stale, "fingerprint": "other settings"}))
    ran = []
    monkeypatch.setattr(learning, "run_arm", lambda *a, **k: ran.append(a[1]) or real_run(*a, **k))
    assert learning.main(args) == 0
    assert ran == [3] and json.loads(cell.read_text())["fingerprint"] == stale["fingerprint"]


def test_paired_differences_pair_the_same_seed_and_problems():
    learning = _learning()
    untrained = learning.ArmResult("untrained team", seeds=[0, 1], problem_ids=[["a", "b", "c"], ["d", "e", "f"]],
                                   problem_scores=[[0.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    arm = learning.ArmResult("trained", seeds=[1, 0, 2], problem_ids=[["d", "e", "f"], ["a", "b", "c"], ["x", "y", "z"]],
                             problem_scores=[[1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    paired = learning.paired_vs_untrained(untrained, arm)
    assert sorted(paired) == [0, 1]  # seed 2 has no untrained run: not paired
    assert paired[1] == {"difference": 1.0, "stderr": 0.0, "problems": 3, "beyond_noise": True}
    assert abs(paired[0]["difference"] - (0.5 + 0.0 + 0.5) / 3) < 1e-12 and paired[0]["stderr"] > 0
    moved = learning.ArmResult("other problems", seeds=[0], problem_ids=[["a", "b", "q"]], problem_scores=[[1.0, 1.0, 1.0]])
    assert learning.paired_vs_untrained(untrained, moved) == {}


def test_warm_started_rl_arms_are_also_paired_with_the_warm_start_alone():
    """After a warm start, beating the untrained team says little about RL: its own effect is the difference
    from the warm start alone, on the same seed and problems (a column of the table and a field of the JSON)."""
    learning = _learning()
    comp = next(c for c in learning.comparisons() if c.key == "m_grpo")
    ids = [["q1", "q2", "q3"]]
    scores = {"untrained team": [0.0, 0.0, 0.0], "warm start only": [0.5, 0.0, 0.5],
              "M-GRPO main + sub, warm start": [1.0, 0.5, 1.0]}
    results = [learning.ArmResult(a.label, seeds=[0], scores=[sum(scores.get(a.label, [0.0]) or [0.0]) / 3], wall=[1.0],
                                  tokens=[0.0], problem_ids=ids, problem_scores=[scores.get(a.label, [0.0, 0.0, 0.0])])
               for a in comp.arms]
    page = learning.render(comp, results, [0], 3, None)
    assert "| paired difference vs warm start only, per seed (RL's own effect) |" in page
    row = next(line for line in page.splitlines() if line.startswith("| M-GRPO main + sub, warm start |"))
    assert row.rstrip().endswith("| s0: +0.500 +/- 0.000 * |"), row
    untrained_row = next(line for line in page.splitlines() if line.startswith("| untrained team |"))
    assert untrained_row.rstrip().endswith("| - |")
    summary = learning.results_json([comp], {comp.key: results}, {comp.key: None}, {comp.key: 3}, "test")
    arms = {a["arm"]: a for a in summary["sections"][0]["arms"]}
    assert arms["M-GRPO main + sub, warm start"]["paired_vs_warm_start"]["0"]["difference"] == 0.5
    assert "paired_vs_warm_start" not in arms["untrained team"] and "paired_vs_warm_start" not in arms["warm start only"]
    # a comparison without a warm-start-only arm has no such column
    magrpo = next(c for c in learning.comparisons() if c.key == "magrpo")
    plain = [learning.ArmResult(a.label, seeds=[0], scores=[0.0], wall=[1.0], tokens=[0.0], problem_ids=ids,
                                problem_scores=[[0.0, 0.0, 0.0]]) for a in magrpo.arms]
    assert "warm start only, per seed" not in learning.render(magrpo, plain, [0], 3, None)


def test_the_page_claims_an_equal_budget_only_when_every_rl_arm_sampled_the_same_episodes():
    learning = _learning()
    magrpo = next(c for c in learning.comparisons() if c.key == "magrpo")

    def page(episodes: dict[str, int]) -> str:
        results = [learning.ArmResult(a.label, seeds=[0], scores=[0.0], wall=[1.0], tokens=[0.0], problem_ids=[["p"]],
                                      problem_scores=[[0.0]], episodes=episodes.get(a.label, 0)) for a in magrpo.arms]
        return learning.render(magrpo, results, [0], 1, None)

    rl = [a.label for a in magrpo.arms if a.rl]
    assert len(rl) >= 2
    assert "Equal budget: every RL arm samples the same episodes" in page({label: 80 for label in rl})
    unequal = page({label: 80 * (i + 1) for i, label in enumerate(rl)})
    assert "Equal budget" not in unequal
    assert "Budgets differ: RL arms sampled 80 to 240 episodes (the episodes column)" in unequal


def test_pick_level_takes_the_band_with_the_most_varied_groups():
    learning = _learning()
    row = lambda sampled, varied: {"sampled_success": sampled, "greedy_success": None, "groups_varied": varied}  # noqa: E731
    rows = {"easy": row(0.8, 0.5), "mid": row(0.3, 0.6), "mid2": row(0.2, 0.4), "hard": row(0.0, 0.0)}
    assert learning.pick_level(rows)[0] == "mid"
    picked, why = learning.pick_level({"hard": row(0.0, 0.0), "harder": row(0.0, 0.0)})
    assert picked == "hard" and why.startswith("no level within 0.15-0.50")
    assert learning.pick_level({}) == (None, "no level measured")


def test_pick_level_prefers_the_greedy_success_the_held_out_score_measures():
    """The held-out score is greedy: a level whose sampled success is in the band but whose greedy success is 0
    (Plan-Path 5x5: sampled 19%, greedy 0%) leaves RL little to show; one with greedy success in the band wins."""
    learning = _learning()
    row = lambda greedy, sampled, varied: {"greedy_success": greedy, "sampled_success": sampled, "groups_varied": varied}  # noqa: E731
    rows = {"3x3": row(0.19, 0.125, 0.09), "4x4": row(0.125, 0.0, 0.125), "5x5": row(0.0, 0.19, 0.19)}
    picked, why = learning.pick_level(rows)
    assert picked == "3x3" and why.startswith("greedy success 0.19 within 0.15-0.50"), why
    # no greedy success in the band: the sampled success decides, as before
    assert learning.pick_level({"4x4": row(0.125, 0.0, 0.125), "5x5": row(0.0, 0.19, 0.19)})[0] == "5x5"


def test_quick_calibration_writes_the_table_and_resumes(tmp_path, monkeypatch):
    """--calibrate --quick: two levels per task on the tiny model (after the warm start where the arm has one),
    into the calibration file and a Markdown table; a second call measures nothing again."""
    import json

    learning = _learning()
    cal, doc = tmp_path / "calibration.json", tmp_path / "learning.md"
    doc.write_text("# page\n\ntext above\n")
    args = ["--quick", "--calibrate", "--only", "at_grpo,study_voting", "--calibration", str(cal), "--calibration-doc", str(doc)]
    assert learning.main(args) == 0
    data = json.loads(cal.read_text())
    comps = {c.key: c for c in learning.comparisons()}
    for key in ("at_grpo", "study_voting"):
        levels = data[key]["levels"]
        assert list(levels) == [lv.label for lv in comps[key].levels[:2]]
        for r in levels.values():
            assert r["problems"] == 2 and 0 <= r["groups_varied"] <= 1 and r["groups"] > 0
            assert r["warm_start"] == comps[key].arms[comps[key].calibration_arm].warm_start
        assert data[key]["picked"] in levels
    text = doc.read_text()
    assert text.startswith("# page\n\ntext above") and text.count(learning.MARK_START) == 1
    assert "| at_grpo | 3x3, walls 0.10 |" in text and "| study_voting | one operation, operands <= 5 |" in text

    def no_level(*a, **k):
        raise AssertionError("a calibrated level was measured again")
    monkeypatch.setattr(learning.learning_calibration, "calibrate_level", no_level)  # where calibrate() looks it up
    assert learning.main(args) == 0
    assert doc.read_text().count(learning.MARK_START) == 1  # the table is replaced, not added twice
    # --render-only: the table from the file, nothing measured (m_grpo, never calibrated, stays out)
    assert learning.main([*args[:3], "at_grpo,study_voting,m_grpo", *args[4:], "--render-only"]) == 0
    assert "m_grpo" not in json.loads(cal.read_text()) and "| m_grpo |" not in doc.read_text()
    # a pick written by an older rule is made again by today's from the levels in the file
    stale = json.loads(cal.read_text())
    stale["at_grpo"]["picked"], stale["at_grpo"]["why"] = "no such level", "an older rule"
    cal.write_text(json.dumps(stale))
    assert learning.main([*args, "--render-only"]) == 0
    assert json.loads(cal.read_text())["at_grpo"]["picked"] == learning.pick_level(stale["at_grpo"]["levels"])[0]


def test_every_level_is_a_valid_config_and_turns_its_knob(tmp_path):
    """The difficulty knobs: each comparison's levels load as configs and make the task they say."""
    from teamrl.tasks import make_task

    learning = _learning()
    for comp in learning.comparisons():
        assert (comp.default_level in {lv.label for lv in comp.levels}) == bool(comp.levels), comp.key
        for lv in comp.levels:
            cfg = learning._config(comp, comp.arms[comp.calibration_arm], False, False, 0, tmp_path, "x", level=lv)
            task = make_task(cfg.task)
            p = task.problems()[0]
            if comp.key == "at_grpo":
                assert len(p.data["grid"]) == cfg.task["min_size"], lv
            elif comp.key == "m_grpo":
                kinds = cfg.task["kinds"].split(",")
                assert {q.data["kind"] for q in task.problems()} == set(kinds), lv
            else:
                assert len(task.problems()) == cfg.task["num_problems"] - learning.EVAL_PROBLEMS
    assert learning.comparisons()[0].level() is None  # writing has no knob here


def test_the_arithmetic_knob_bounds_the_operands_and_keeps_the_default_problems():
    import re as _re

    from teamrl.tasks.math_env import generate_arithmetic

    default = generate_arithmetic(30, seed=1, easy=True)
    assert [p.id for p in default][:2] == ["math/generated_easy/1/0", "math/generated_easy/1/1"]
    assert [p.data for p in generate_arithmetic(30, seed=1, easy=True, max_operand=20)] == [p.data for p in default]
    small = generate_arithmetic(60, seed=1, easy=True, max_operand=5)
    assert all(int(n) <= 5 for p in small for n in _re.findall(r"\d+", p.data["expression"]))
    assert small[0].id == "math/generated_easy-5/1/0"


def test_arms_evaluated_once_fill_every_seed_and_the_runs_go_seed_by_seed(tmp_path, monkeypatch):
    """MAGRPO's untrained team and prompt baselines do not depend on the seed (base weights, greedy, the aclsum
    test split): each runs once, its one cell stands for every seed and pairs with each seed's MAGRPO run; the
    runs go seed by seed (untrained, MAGRPO seed 0, 1, 2), the other arms evaluated once last."""
    import json

    learning = _learning()
    order = []

    def fake_run(comp, index, seed, workdir, eval_problems, quick, result, one_thread=False, level=None):
        order.append((index, seed))
        score = 0.25 * index + 0.01 * seed  # MAGRPO (arm 3): 0.75 + 0.01 x seed on every problem
        result.seeds.append(seed)
        result.scores.append(score)
        result.wall.append(1.0)
        result.tokens.append(0.0)
        result.problem_ids.append(["p0", "p1"])
        result.problem_scores.append([score, score])
        result.signal.append(None)
        result.signal_groups.append([0, 0])
    monkeypatch.setattr(learning, "run_arm", fake_run)
    out, cells = tmp_path / "LEARNING.md", tmp_path / "cells"
    args = ["--quick", "--only", "magrpo", "--seeds", "3", "--out", str(out), "--cells", str(cells)]
    assert learning.main(args) == 0
    # the seed-dependent arms (MAGRPO, 2 and 4 papers per step, 20 steps) seed by seed, the prompt baselines last
    assert order == [(0, 0), (3, 0), (4, 0), (5, 0), (3, 1), (4, 1), (5, 1), (3, 2), (4, 2), (5, 2), (1, 0), (2, 0)]
    assert len(list((cells / "magrpo").iterdir())) == 12
    untrained, sequential, _, magrpo, *_ = json.loads((tmp_path / "learning_results.json").read_text())["sections"][0]["arms"]
    assert untrained["seeds"] == sequential["seeds"] == magrpo["seeds"] == [0, 1, 2]
    assert untrained["evaluated_once"] and untrained["wall_s"] == [1.0, 1.0, 1.0]
    assert {k: round(v["difference"], 6) for k, v in magrpo["paired_vs_untrained"].items()} == {"0": 0.75, "1": 0.76, "2": 0.77}
    assert {k: v["difference"] for k, v in sequential["paired_vs_untrained"].items()} == {"0": 0.25, "1": 0.25, "2": 0.25}
    assert "Evaluated once and reused for every seed" in out.read_text()
    # a second run reads the twelve cells and runs nothing
    order.clear()
    assert learning.main(args) == 0 and order == [] and "12 runs read from the cache" in out.read_text()


def test_arms_runs_only_the_named_arms_and_still_reads_every_cell(tmp_path, monkeypatch, capsys):
    """--arms 3,0 runs only MAGRPO and the untrained team (grid order, seed by seed); a later run without it
    reads their cells and runs the rest; an index past the comparison's arms is refused, naming the range."""
    learning = _learning()
    order = []

    def fake_run(comp, index, seed, workdir, eval_problems, quick, result, one_thread=False, level=None):
        order.append((index, seed))
        result.seeds.append(seed)
        result.scores.append(0.5)
        result.wall.append(1.0)
        result.tokens.append(0.0)
        result.problem_ids.append(["p0"])
        result.problem_scores.append([0.5])
        result.signal.append(None)
        result.signal_groups.append([0, 0])
    monkeypatch.setattr(learning, "run_arm", fake_run)
    out, cells = tmp_path / "LEARNING.md", tmp_path / "cells"
    args = ["--quick", "--only", "magrpo", "--seeds", "2", "--out", str(out), "--cells", str(cells)]
    assert learning.main([*args, "--arms", "3,0"]) == 0
    assert order == [(0, 0), (3, 0), (3, 1)]
    assert "partial: 3 of 9 runs" in out.read_text()
    order.clear()
    assert learning.main(args) == 0
    assert sorted(order) == [(1, 0), (2, 0), (4, 0), (4, 1), (5, 0), (5, 1)]
    assert learning.main([*args, "--arms", "9"]) == 2
    assert "--arms 9" in capsys.readouterr().err


def test_a_run_that_would_wait_on_a_warm_start_being_built_gives_way(tmp_path):
    learning = _learning()
    seed0, seed1 = tmp_path / "m_grpo-warm-seed0", tmp_path / "m_grpo-warm-seed1"
    pending = [seed0, seed0, seed1, None]  # seed 0's other warm-started arms, seed 1's, an arm without a warm start
    assert learning.next_run(pending, set()) == 0  # nothing going: grid order
    assert learning.next_run(pending, {seed0}) == 2  # seed 0's warm start is being built: seed 1 builds its own
    assert learning.next_run(pending, {seed0, seed1}) == 3  # both being built: the run without a warm start
    assert learning.next_run(pending[:3], {seed0, seed1}) == 0  # every run would wait: the first
    seed0.mkdir()
    (seed0 / "seconds").write_text("12.0")
    assert learning.next_run(pending, {seed0}) == 0  # built: its arms no longer wait
    comp = next(c for c in learning.comparisons() if c.key == "at_grpo")
    shared = learning.warm_start_dir(comp, 1, tmp_path, None, comp.arms[2])
    labels = [a.label for a in comp.arms]
    per_role = learning.warm_start_dir(comp, 1, tmp_path, None, comp.arms[labels.index("warm start only, per-role policies")])
    assert comp.arms[2].warm_start and shared.name == "at_grpo-warm-seed1" and per_role != shared  # its own policy mode
    # the team's warm start scored planner-alone is the team's, not one of its own
    assert learning.warm_start_dir(comp, 1, tmp_path, None, comp.arms[labels.index("warm start only, planner alone")]) == shared


def test_gradient_norm_spikes_are_counted_per_seed_and_rendered_with_the_paired_score(tmp_path):
    learning = _learning()
    import learning_render
    import learning_stats

    comp = next(c for c in learning.comparisons() if c.key == "adv_scope_magrpo")
    ids = [["p0", "p1"]]
    agent = learning.ArmResult(comp.arms[1].label, seeds=[0], grad_norms=[[1.0, 1.2, 0.8, 1.0]], problem_ids=ids,
                               problem_scores=[[0.5, 0.5]])
    team = learning.ArmResult(comp.arms[2].label, seeds=[0], grad_norms=[[1.0, 5.0, 0.9, 4.0]], problem_ids=ids,
                              problem_scores=[[0.25, 0.25]])
    stats = learning_stats.grad_norm_stats(team)
    assert stats == [{"median": 2.5, "max": 5.0, "steps": 4, "spikes": 0}]  # 5.0 is not over 3 x 2.5
    assert learning_stats.grad_norm_stats(team, factor=1.5) == [{"median": 2.5, "max": 5.0, "steps": 4, "spikes": 2}]
    assert learning_stats.grad_norm_stats(learning.ArmResult("x", seeds=[0], grad_norms=[[]])) == [None]
    table = learning_render.render_grad_norms(comp, [learning.ArmResult("untrained team"), agent, team], factor=1.5)
    assert f"| {agent.label} | s0: 1.000 / 1.200 | s0: 0 of 4 | - |" in table
    assert f"| {team.label} | s0: 2.500 / 5.000 | s0: 2 of 4 | s0: -0.250 +/- 0.000 * |" in table  # paired, problem by problem
    # a cell cached before the gradient norms were recorded reads with an empty list per seed (the lists stay aligned)
    fp = learning.cell_fingerprint(comp, 1, 48, False, None)
    path = tmp_path / "old.json"
    learning.write_cell(path, fp, comp, None, agent)
    cell = json.loads(path.read_text())
    del cell["result"]["grad_norms"]
    path.write_text(json.dumps(cell))
    assert learning.read_cell(path, fp).grad_norms == [[]]


def test_held_out_dynamics_finds_the_peak_the_final_and_each_cliff_under_the_running_peak():
    _learning()
    import learning_render
    import learning_stats

    curve = [[0, 0.30], [5, 0.50], [10, 0.35], [15, 0.45], [20, 0.38]]
    assert learning_stats.held_out_dynamics(curve) == {"start": 0.30, "peak": 0.50, "peak_step": 5, "final": 0.38,
                                                       "cliffs": 2}  # 0.35 and 0.38 are over 10 points under 0.50
    assert learning_stats.held_out_dynamics(curve, points=14)["cliffs"] == 1 and learning_stats.held_out_dynamics([]) is None
    arm = _learning().ArmResult("IP", seeds=[0], curves=[[0.1, 0.2, 0.3]], eval_curves=[curve],
                                role_grad_norms=[{"aggregator": 1.0, "generator": 3.0}])
    table = learning_render.render_study_dynamics([arm])
    assert "| s0: 0.300 -> 0.500 (5) -> 0.380 | s0: 2 | aggregator 1.00, generator 3.00 | aggregator 0.25, generator 0.75 |" in table


def test_a_child_run_keeps_its_cell_and_a_parent_of_other_code_says_so(tmp_path, monkeypatch, capsys):
    """A --run-cell child writes its finished run's cell itself; a parent whose ArmResult lacks a field the child
    returned names it and where the cell is (the run is not lost: a grid started again reads it)."""
    import subprocess

    learning = _learning()
    import learning_runner

    comp = next(c for c in learning.comparisons() if c.key == "study_voting")
    cell = tmp_path / "cells" / "untrained.json"
    assert learning.main(["--run-cell", comp.key, "0", "0", "--workdir", str(tmp_path), "--eval", "2", "--quick",
                          "--cell", str(cell), "--fingerprint", "f00d"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kept = learning.read_cell(cell, "f00d")
    assert kept is not None and kept.scores == printed["scores"] and kept.seeds == [0]

    def newer_child(cmd, **kwargs):
        assert cmd[cmd.index("--cell") + 1] == str(cell) and cmd[cmd.index("--fingerprint") + 1] == "f00d"
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({**printed, "a_newer_field": [1]}) + "\n")
    monkeypatch.setattr(learning_runner.subprocess, "run", newer_child)
    with pytest.raises(RuntimeError, match=r"returned fields \['a_newer_field'\].*kept in .*untrained.json"):
        learning_runner.run_arm_in_process(comp, 0, 0, tmp_path, 2, True, True, cell=cell, fingerprint="f00d")


def test_each_roles_own_reward_is_rendered_first_steps_to_last_per_seed():
    learning = _learning()
    import learning_render

    arm = learning.ArmResult("tree", seeds=[0, 1], role_local_rewards=[{"tool/turn0": [0.0, 0.2, 0.2, 1.0, 1.0, 1.0]},
                                                                          {"tool/turn0": [0.2, 0.2, 0.2, 0.2]}])
    table = learning_render.render_local_rewards([learning.ArmResult("untrained team"), arm], window=3)
    assert "| tree | tool/turn0 | s0: 0.133 -> 1.000; s1: 0.200 -> 0.200 |" in table and "untrained" not in table


def test_each_roles_held_out_own_reward_is_kept_per_seed_and_rendered_for_untrained_arms_too():
    """AT-GRPO's tool earns its reward when its greedy program solves held-out grids: the evaluation's calls
    carry each role's own reward; the arm keeps its mean and the share of calls at 1 (a solving program)."""
    learning = _learning()
    import learning_render
    import learning_runner
    from types import SimpleNamespace

    calls = [[{"role": "tool", "own_reward": 1.0}, {"role": "planner", "own_reward": None}],
             [{"role": "tool", "own_reward": 0.2}, {"role": "planner", "own_reward": None}],
             [{"role": "tool", "own_reward": 1.0}], [{"role": "tool", "own_reward": 0.0}]]
    row = SimpleNamespace(mean=0.5, scores=[1.0, 0.0, 1.0, 0.0], pass_at_1=None, valid=None,
                          episodes=[{"problem_id": f"p{i}", "calls": c} for i, c in enumerate(calls)])
    warm = learning_runner._scored(learning.ArmResult("warm start only", seeds=[3]), row)
    assert warm.held_out_own_rewards == [{"tool": {"mean": 0.55, "at_one": 0.5}}]  # the planner has none
    table = learning_render.render_local_rewards([learning.ArmResult("untrained team"), warm])
    assert "| warm start only | tool | s3: 0.550 (0.50 at >= 1) |" in table and "untrained" not in table


def test_a_comparison_runs_at_the_level_the_comparison_it_follows_picked():
    learning = _learning()
    comps = {c.key: c for c in learning.comparisons()}
    picked = {"study_voting": {"picked": "one operation, operands <= 20"}, "adv_scope_voting": {"picked": "no such level"}}
    assert comps["adv_scope_voting"].level(picked).label == "one operation, operands <= 20"  # Voting's own pick
    assert comps["adv_scope_voting"].level({}).label == "one operation, operands <= 5"  # uncalibrated: its default
    assert comps["study_voting"].level(picked).label == "one operation, operands <= 20"


def test_an_arm_with_a_warm_start_of_its_own_pairs_with_that_warm_start_alone():
    learning = _learning()
    import learning_stats

    comp = next(c for c in learning.comparisons() if c.key == "study_voting")
    labels = [a.label for a in comp.arms]
    ids = [["p0", "p1"]]

    def one(label, scores):
        return learning.ArmResult(label, seeds=[0], scores=[sum(scores) / 2], problem_ids=ids, problem_scores=[scores])
    results = [learning.ArmResult(a.label) for a in comp.arms]
    results[labels.index("warm start only")] = one("warm start only", [0.0, 0.0])
    results[labels.index("SP (shared policy), warm start")] = one("SP", [1.0, 0.0])
    results[labels.index("IP (LoRA per role), warm start")] = one("IP", [1.0, 1.0])
    paired = learning_stats.paired_vs_warm_start(comp, results)
    assert paired[labels.index("IP (LoRA per role), warm start")][0]["difference"] == 1.0  # no IP warm start run yet: the shared
    results[labels.index("warm start only, IP (LoRA per role)")] = one("IP warm", [1.0, 0.0])
    paired = learning_stats.paired_vs_warm_start(comp, results)
    assert paired[labels.index("IP (LoRA per role), warm start")][0]["difference"] == 0.5  # against its own warm start
    assert paired[labels.index("SP (shared policy), warm start")][0]["difference"] == 0.5  # SP's is the shared one
    assert paired[labels.index("warm start only, IP (LoRA per role)")] is None  # not trained by RL


def test_the_single_agent_pairs_with_the_warm_start_scored_alone_and_the_team_arms_with_the_teams():
    """AT-GRPO's single agent (task.agents=planner) starts from the team's warm start but acts without the tool:
    its RL's own effect is against that warm start scored planner-alone, not the team's."""
    learning = _learning()
    import learning_stats

    comp = next(c for c in learning.comparisons() if c.key == "at_grpo")
    labels = [a.label for a in comp.arms]
    ids = [["p0", "p1"]]

    def one(scores):
        return learning.ArmResult("x", seeds=[0], scores=[sum(scores) / 2], problem_ids=ids, problem_scores=[scores])
    results = [learning.ArmResult(a.label) for a in comp.arms]
    results[labels.index("warm start only")] = one([1.0, 1.0])
    results[labels.index("warm start only, planner alone")] = one([0.0, 0.0])
    results[labels.index("single-agent GRPO (planner alone), warm start")] = one([0.5, 0.5])
    results[labels.index("AT-GRPO, tree grouping, warm start")] = one([0.5, 0.5])
    paired = learning_stats.paired_vs_warm_start(comp, results)
    assert paired[labels.index("single-agent GRPO (planner alone), warm start")][0]["difference"] == 0.5
    assert paired[labels.index("AT-GRPO, tree grouping, warm start")][0]["difference"] == -0.5


def test_a_memory_setting_keeps_the_cells_fingerprint_and_another_setting_changes_it():
    """train.micro_batch_size splits the same gradient into smaller passes (memory only): a comparison given one
    keeps its cells; any other setting added makes them cells of other settings."""
    import dataclasses

    learning = _learning()
    comp = next(c for c in learning.comparisons() if c.key == "at_grpo")
    assert "train.micro_batch_size=4" in comp.common
    fp = learning.cell_fingerprint(comp, 1, 48, False, None)
    bare = dataclasses.replace(comp, common=tuple(o for o in comp.common if not o.startswith("train.micro_batch_size=")))
    assert learning.cell_fingerprint(bare, 1, 48, False, None) == fp
    other = dataclasses.replace(comp, common=(*comp.common, "train.max_grad_norm=0.5"))
    assert learning.cell_fingerprint(other, 1, 48, False, None) != fp

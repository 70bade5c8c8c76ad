"""``make learn`` / ``teamrl bench --learning``: the --quick smoke run of the whole grid on the tiny model."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

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
    assert learning.main(["--quick", "--out", str(out)]) == 0
    page = out.read_text()
    assert "--quick smoke run" in page and re.search(r"wall time \d+ s", page)
    for comp in learning.comparisons():
        assert f"### {comp.title}" in page
        for arm in comp.arms:
            row = next(line for line in page.splitlines() if line.startswith(f"| {arm.label} |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert 0.0 <= float(cells[1]) <= 1.0, row  # held-out normalised return of the one seed
            assert (cells[5] != "-") == arm.rl, row  # RL arms sampled episodes; the others none
        png = tmp_path / f"LEARNING_{comp.key}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and f"]({png.name})" in page
    for section in page.split("### ")[1:]:  # the study flags arms whose held-out accuracy fell under the untrained team's
        assert ("Accuracy cliffs (held-out accuracy" in section) == section.startswith("Workflow study"), section
    # equal budgets: every RL arm of a comparison sampled the same number of episodes
    for section in page.split("### ")[1:]:
        episodes = {line.split("|")[6].strip() for line in section.splitlines() if line.startswith("| ") and "---" not in line
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
    assert learning.main(["--quick", "--jobs", "2", "--only", "magrpo", "--seeds", "2", "--out", str(out)]) == 0
    page = out.read_text()
    for arm in next(c for c in learning.comparisons() if c.key == "magrpo").arms:
        row = next(line for line in page.splitlines() if line.startswith(f"| {arm.label} |"))
        score = row.split("|")[2].strip()
        assert re.fullmatch(r"\d\.\d{3} \(\d\.\d{3}\.\.\d\.\d{3}\)", score), row  # mean (min..max) over the 2 seeds
    assert learning.main(["--quick", "--jobs", "0", "--only", "magrpo", "--out", str(out)]) == 2


def test_a_stopped_run_leaves_the_runs_it_finished(tmp_path, monkeypatch):
    """The page is written after every run, so a grid stopped part-way keeps what it measured."""
    import pytest

    learning = _learning()
    real, calls = learning.run_arm, []

    def stops_at_the_second_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stopped")
        return real(*args, **kwargs)

    monkeypatch.setattr(learning, "run_arm", stops_at_the_second_run)
    out = tmp_path / "LEARNING.md"
    with pytest.raises(RuntimeError, match="stopped"):
        learning.main(["--quick", "--only", "magrpo", "--out", str(out)])
    page = out.read_text()
    assert "partial: 1 of 2 runs finished so far" in page
    assert re.search(r"^\| untrained team \| \d\.\d{3} \|", page, re.M) and "| MAGRPO | not run yet |" in page


def test_held_out_cliffs_pair_each_arm_with_the_untrained_team_of_its_seed():
    learning = _learning()
    untrained = learning.ArmResult("untrained team", seeds=[1, 0], success=[0.5, 0.2])
    steady = learning.ArmResult("SP", seeds=[0, 1], success=[0.2, 0.45])  # 5 points under on seed 1: no cliff
    fell = learning.ArmResult("IP", seeds=[0, 1], success=[0.3, 0.25])  # seed 1: 25 points under
    line = learning.held_out_cliffs([untrained, steady, fell])
    assert line.endswith("IP (seed 1: 25% vs 50%).") and "SP" not in line
    assert learning.held_out_cliffs([untrained, steady]).endswith(": none.")

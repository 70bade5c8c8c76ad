"""What ``teamrl eval`` writes (results.json, one JSONL of episodes per method) and the HTML report,
checked in a real browser (headless Chromium; skipped only where it is not installed)."""

import json
import os
import re
import shutil
import subprocess

import pytest

from teamrl.cli import main
from teamrl.tasks import TASKS
from teamrl.trainer.report import write_report
from tests.test_magrpo import ToyTeam

# a completion a model could write: shown as text, never run
HOSTILE = ("<script>document.body.setAttribute('data-pwned','1')</script><img src=x onerror=\"document.body.setAttribute("
           "'data-pwned','2')\"> \x00\x1b[31m")
ARGS = ["model=tiny-random", "threads=1", "algorithm=magrpo", "task.name=toy_team", "name=ev", "rollout.max_new_tokens=8",
        "rollout.batch_size=2", "rollout.group_size=2", "train.steps=2", "run.progress=false", "policy.mode=lora_per_role",
        "policy.lora.r=4", "train.lr=5e-2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trained two-role run (2 steps on the tiny model, its final eval on 2 problems) and one
    `teamrl eval` of it on 3 problems."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TASKS, "toy_team", ToyTeam)
        assert main(["train", *ARGS, f"run.dir={root}", "train.final_eval_problems=2"]) == 0
        assert main(["eval", "--checkpoint", str(root / "ev"), "--limit", "3", "--method", "team,untrained"]) == 0
        yield root / "ev"


def _eval_dir(run, command):
    """The eval folder of the run whose results.json was written by ``command`` (teamrl train or eval)."""
    (out,) = [d for d in (run / "eval").iterdir()
              if json.loads((d / "results.json").read_text())["command"].startswith(f"teamrl {command} ")]
    return out


def test_final_eval_of_train_writes_its_results_too(run):
    results = json.loads((_eval_dir(run, "train") / "results.json").read_text())
    assert list(results["methods"]) == ["untrained", "team"] and results["problems"]["ids"] == ["t0", "t1"]
    assert len((_eval_dir(run, "train") / "team.jsonl").read_text().splitlines()) == 2


def test_eval_writes_results_and_every_episode(run, capsys):
    out = _eval_dir(run, "eval")
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"team", "untrained"}
    assert results["command"].startswith("teamrl eval --checkpoint") and results["config"]["task"]["name"] == "toy_team"
    assert results["problems"]["held_out"] is False and results["checkpoint_step"] == 2 and results["limit"] == 3 and results["problems"]["ids"] == ["t0", "t1", "t2"]
    (c,) = results["comparisons"]
    team, untrained = results["methods"]["team"], results["methods"]["untrained"]
    assert (c["trained"], c["untrained"], c["problems"]) == ("team", "untrained", 3)
    assert c["difference"] == pytest.approx(team["mean"] - untrained["mean"]) and c["stderr"] >= 0
    for method, row in results["methods"].items():
        episodes = [json.loads(line) for line in (out / f"{method}.jsonl").read_text().splitlines()]
        assert [e["problem_id"] for e in episodes] == ["t0", "t1", "t2"]
        assert [e["score"] for e in episodes] == pytest.approx(row["scores"])
        for e in episodes:
            assert e["method"] == method and e["team_return"] == pytest.approx(e["score"] * ToyTeam.max_reward)
            assert [call["role"] for call in e["calls"]] == ["short", "long"]
            for call in e["calls"]:
                assert call["messages"][0]["role"] == "user" and call["role"] in call["messages"][0]["content"]
                assert call["prompt_tokens"] > 0 and 0 < call["completion_tokens"] <= 8 and isinstance(call["completion"], str)
        assert row["replies_per_problem"] == 2
    # trained and untrained differ in their policies: the trained team's calls went to its adapters
    first_team = json.loads((out / "team.jsonl").read_text().splitlines()[0])
    first_base = json.loads((out / "untrained.jsonl").read_text().splitlines()[0])
    assert [c["policy"] for c in first_team["calls"]] == ["short", "long"]
    assert {c["policy"] for c in first_base["calls"]} == {"__base__"}


def test_eval_of_the_base_model_writes_under_run_dir_or_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(TASKS, "toy_team", ToyTeam)
    base = [*ARGS, f"run.dir={tmp_path}"]
    assert main(["eval", "--limit", "1", "--method", "untrained", "--out", str(tmp_path / "mine"), *base]) == 0
    assert "mine/results.json" in capsys.readouterr().out
    assert json.loads((tmp_path / "mine" / "results.json").read_text())["checkpoint"] is None
    assert len((tmp_path / "mine" / "untrained.jsonl").read_text().splitlines()) == 1
    assert main(["eval", "--limit", "1", "--method", "untrained", *base]) == 0
    (where,) = tmp_path.glob("eval-*")
    assert f"{where}/results.json" in capsys.readouterr().out and (where / "untrained.jsonl").is_file()


def _report_with_hostile_completion(run):
    """The run's report after one of the trained team's completions was replaced by :data:`HOSTILE`."""
    out = _eval_dir(run, "eval")  # the latest: the one the report shows
    lines = (out / "team.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["calls"][0]["completion"] = HOSTILE
    (out / "team.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    return write_report(run)


def test_report_page_is_self_contained_and_escapes_model_text(run):
    page = _report_with_hostile_completion(run)
    text = page.read_text()
    assert page.name == "index.html" and (page.parent / "report.md").is_file()
    assert text.count("<script") == 1 and "&lt;script&gt;document.body.setAttribute" in text
    assert "\\x00\\x1b[31m" in text and not re.search("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", text)  # controls shown, not kept
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text) and "@import" not in text  # loads nothing
    assert 'id="eval-table"' in text and 'id="problem-select"' in text and 'id="step-select"' in text
    assert "problems: the training problems (the task holds none out)" in text  # toy_team holds no problems out
    for chart in ("reward and normalised return", "loss per policy", "KL to the reference per policy",
                  "gradient norm per policy (before clipping)"):
        assert f"<figcaption>{chart}</figcaption><svg" in text
    assert "team - untrained:" in (page.parent / "report.md").read_text()  # the markdown page has the eval table too


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def _chromium(tmp_path, *args, url):
    """Run headless Chromium on ``url``; its stdout."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", *args, url]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_report_renders_in_headless_chromium(run, tmp_path):
    from PIL import Image

    page = _report_with_hostile_completion(run)
    dom = _chromium(tmp_path, "--dump-dom", url=page.as_uri())
    assert 'data-ready="1"' in dom  # the page's script ran (the CSP let it)
    table = re.search(r'<table id="eval-table">.*?</table>', dom, re.S).group(0)
    assert "<th>team</th>" in table and "<th>untrained</th>" in table
    shown = re.findall(r'<section class="problem" data-key="(\d+)"( hidden="")?>', dom)
    assert [(k, bool(h)) for k, h in shown] == [("0", False), ("1", True), ("2", True)]
    first = dom[dom.index('<section class="problem" data-key="0"'):dom.index('<section class="problem" data-key="1"')]
    assert first.count('<div class="call">') == 4  # two roles x (trained, untrained), side by side
    assert "&lt;script&gt;document.body.setAttribute" in first and "data-pwned" not in dom.replace("'data-pwned'", "")
    # the picker: #problem=2 shows the third problem alone
    dom2 = _chromium(tmp_path, "--dump-dom", url=page.as_uri() + "#problem=2")
    shown = re.findall(r'<section class="problem" data-key="(\d+)"( hidden="")?>', dom2)
    assert [(k, bool(h)) for k, h in shown] == [("0", True), ("1", True), ("2", False)]
    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1800", "--hide-scrollbars", url=page.as_uri())
    image = Image.open(shot).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    assert image.size == (1280, 1800) and len(colours) > 20  # text, charts and tables, not a blank page


def test_report_of_a_broken_eval_file_is_one_line(run, tmp_path, capsys):
    copy = tmp_path / "ev"
    shutil.copytree(run, copy)
    (_eval_dir(copy, "eval") / "team.jsonl").write_text("{not json\n")
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "team.jsonl: line 1 is not JSON" in err and len(err.strip().splitlines()) == 1


# ---- issue 44 H15: structurally wrong files -------------------------------------------------------------------------

def _metrics_lines(run_dir):
    return (run_dir / "metrics.jsonl").read_text().splitlines()


@pytest.mark.parametrize("bad_line", ["null", "3", "[1, 2]", '{"step": "three", "reward_mean": 1.0}',
                                      '{"reward_mean": 1.0}', '{"step": 2, "reward_mean": 1.0, "update_s": "slow"}',
                                      '{"step": 3, "eval/accuracy": "high"}'])
def test_report_skips_and_counts_a_malformed_metrics_line(run, tmp_path, capsys, bad_line):
    """old: a null, number or list line, a string step, a missing step, non-numeric seconds or a string eval/accuracy
    in metrics.jsonl ended `teamrl report` in a traceback."""
    copy = tmp_path / "ev"
    shutil.copytree(run, copy)
    lines = _metrics_lines(copy)
    (copy / "metrics.jsonl").write_text("\n".join([lines[0], bad_line, *lines[1:]]) + "\n")
    assert main(["report", str(copy)]) == 0
    err = capsys.readouterr().err
    assert f"{copy / 'metrics.jsonl'}: skipped 1 malformed line (line 2)" in err, err
    assert "skipped 1 malformed line" in (copy / "report" / "report.md").read_text()


@pytest.mark.parametrize("results", ["[]", '{"methods": []}', '{"methods": {"team": 3}}'])
def test_report_of_a_results_file_of_the_wrong_shape_is_one_line(run, tmp_path, capsys, results):
    copy = tmp_path / "ev"
    shutil.copytree(run, copy)
    path = _eval_dir(copy, "eval") / "results.json"
    path.write_text(results)
    os.utime(path)  # the newest: the one the report reads
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not a results file of teamrl eval" in err and len(err.strip().splitlines()) == 1, err


def test_report_of_an_episodes_line_that_is_a_list_is_one_line(run, tmp_path, capsys):
    copy = tmp_path / "ev"
    shutil.copytree(run, copy)
    (_eval_dir(copy, "eval") / "team.jsonl").write_text("[1, 2]\n")
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "team.jsonl: line 1 is not a JSON object" in err and len(err.strip().splitlines()) == 1, err


def test_report_where_the_report_folder_is_a_file_is_one_line(run, tmp_path, capsys):
    copy = tmp_path / "ev"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "report", ignore_errors=True)
    (copy / "report").write_text("x")
    assert main(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert str(copy / "report") in err and len(err.strip().splitlines()) == 1, err

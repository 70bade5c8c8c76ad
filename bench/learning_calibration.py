"""The learning benchmark's calibration (``bench/learning.py --calibrate``): each task's difficulty levels
scored with the embedded model, one picked per comparison, and the table in docs/learning.md."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from learning_grid import Comparison, Level, _config, _overrides, _slug
from learning_runner import shared_warm_start

# calibration: the band of sampled success that gives groups signal, and its defaults
BAND = (0.15, 0.50)
CALIBRATE_PROBLEMS = 16


def _sampled_signal(load, checkpoint: Path | None, problems: int) -> dict[str, Any]:
    """At the training temperature and group size, on ``problems`` training problems: the share of groups whose
    rewards vary and the sampled success, measured as ``teamrl calibrate`` measures them (one way to measure signal:
    :func:`teamrl.trainer.calibrate.measure`, groups of G episodes per problem)."""
    from teamrl.trainer.calibrate import measure

    (result,) = measure(load, [()], problems=problems, checkpoint=checkpoint, progress=False).results
    f = result.figures
    return {"sampled_success": f["success"], "sampled_reward": f["reward_mean"],
            "groups_varied": f["groups_varied_share"], "groups": f["groups"], "groups_with_signal": f["groups_varied"],
            "group_size": result.group_size, "measured_by": "teamrl calibrate"}


def calibrate_level(comp: Comparison, level: Level, quick: bool, workdir: Path, problems: int, seed: int = 0) -> dict[str, Any]:
    """One level's row: greedy success and valid replies on held-out problems and, at the training temperature
    with the comparison's group size, success and the share of groups that vary; after the warm start where
    the calibrated arm has one."""
    from teamrl.trainer.evaluate import evaluate, held_out_config

    arm = comp.arms[comp.calibration_arm]
    name = f"{comp.key}-calibrate-{_slug(level.label)}"
    t0 = time.perf_counter()
    cfg = _config(comp, arm, quick, False, seed, workdir, name, f"run.save_every={10**6}", level=level)
    if arm.warm_start:
        warm_dir, _ = shared_warm_start(comp, seed, workdir, quick, False, level, arm)
        shutil.copytree(warm_dir / "checkpoints", workdir / name / "checkpoints")
        (workdir / name / "metrics.jsonl").touch()
    held, _ = held_out_config(cfg)
    method = "team" if arm.warm_start else "untrained"
    (row,) = evaluate(held, [method], checkpoint=workdir / name if arm.warm_start else None, limit=problems, progress=False)
    out = {"settings": list(level.overrides), "warm_start": arm.warm_start, "problems": row.problems,
           "greedy_success": row.pass_at_1, "greedy_return": row.mean, "valid": row.valid,
           "temperature": cfg.rollout.temperature, "group_size": cfg.rollout.group_size}
    out.update(_sampled_signal(lambda extra: _config(comp, arm, quick, False, seed, workdir, name, f"run.save_every={10**6}",
                                                     *extra, level=level),
                               workdir / name if arm.warm_start else None, problems))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def pick_level(rows: dict[str, dict[str, Any]], band: tuple[float, float] = BAND) -> tuple[str | None, str]:
    """(the level to run at, why): of the levels whose greedy success (what the held-out score measures) is in
    ``band`` and whose groups varied, the one with the most varied groups; failing that, the same by sampled
    success (greedy where none was sampled); failing that, the level with the most varied groups (said so);
    None when no level was measured."""
    if not rows:
        return None, "no level measured"

    def rate(r: dict[str, Any]) -> float | None:
        return r["sampled_success"] if r.get("sampled_success") is not None else r.get("greedy_success")
    for name, success in (("greedy success", lambda r: r.get("greedy_success")), ("success", rate)):
        inside = {k: r for k, r in rows.items()
                  if success(r) is not None and band[0] <= success(r) <= band[1] and r["groups_varied"] > 0}
        if inside:
            best = max(inside, key=lambda k: inside[k]["groups_varied"])
            return best, f"{name} {success(inside[best]):.2f} within {band[0]:.2f}-{band[1]:.2f}, the most varied groups of those"
    best = max(rows, key=lambda k: (rows[k]["groups_varied"], rate(rows[k]) or 0.0))
    return best, (f"no level within {band[0]:.2f}-{band[1]:.2f} success with varied groups: the most varied groups "
                  f"({100 * rows[best]['groups_varied']:.0f}%)")


def _fmt(x: Any, pct: bool = True) -> str:
    return "-" if x is None else (f"{100 * x:.0f}%" if pct else f"{x:.3f}")


def calibration_markdown(calibration: dict[str, Any], grid: list[Comparison]) -> str:
    """The calibration table (Markdown) of every comparison calibrated."""
    lines = ["| comparison | level | settings | warm start | problems | greedy success | valid replies | "
             "sampled success (T, G) | groups varied | picked |", "|---|---|---|---|---|---|---|---|---|---|"]
    for comp in grid:
        entry = calibration.get(comp.key)
        if not entry:
            continue
        for lv in comp.levels:
            r = entry["levels"].get(lv.label)
            if r is None:
                continue
            lines.append(f"| {comp.key} | {lv.label} | `{' '.join(r['settings'])}` | {'yes' if r['warm_start'] else 'no'} | "
                         f"{r['problems']} | {_fmt(r['greedy_success'])} | {_fmt(r['valid'])} | "
                         f"{_fmt(r['sampled_success'])} (T={r['temperature']:g}, G={r['group_size']}) | "
                         f"{_fmt(r['groups_varied'])} ({r['groups_with_signal']} of {r['groups']}) | "
                         f"{'**yes**' if entry.get('picked') == lv.label else ''} |")
    picks = [f"- {c.key}: {calibration[c.key]['picked']} ({calibration[c.key]['why']})" for c in grid
             if calibration.get(c.key, {}).get("picked")]
    return "\n".join(lines + [""] + picks) + "\n"


MARK_START, MARK_END = "<!-- calibration table: written by bench/learning.py --calibrate -->", "<!-- end of calibration table -->"


def write_calibration_doc(doc: Path, table: str, mode: str) -> None:
    """Put ``table`` between the markers of ``doc`` (appended under a heading the first time)."""
    text = doc.read_text() if doc.is_file() else ""
    block = f"{MARK_START}\n\n_{mode}; table written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}_\n\n{table}\n{MARK_END}"
    if MARK_START in text and MARK_END in text:
        text = text[:text.index(MARK_START)] + block + text[text.index(MARK_END) + len(MARK_END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + "### The calibration table\n\n" + block + "\n"
    doc.write_text(text)


def calibrate(grid: list[Comparison], quick: bool, path: Path, doc: Path | None, problems: int, workdir: Path,
              redo: bool = False, measure: bool = True) -> dict[str, Any]:
    """Measure each comparison's levels (those already in ``path`` with the same settings are kept: resumable),
    pick one per comparison, write ``path`` after every level and the table into ``doc``; ``measure=False``:
    only the picks and the table, from the levels in ``path``."""
    calibration = json.loads(path.read_text()) if path.is_file() else {}
    mode = "--quick (tiny random model: says nothing about the embedded model)" if quick else "SmolLM2-135M"
    for comp in grid:
        levels = comp.levels[:2] if quick else comp.levels
        if levels and measure:
            entry = calibration.setdefault(comp.key, {"levels": {}})
            for lv in levels:
                key = hashlib.sha256(json.dumps([_overrides(comp, comp.arms[comp.calibration_arm], quick, False, lv), problems,
                                                 comp.warm_roles, comp.warm_problems, comp.warm_epochs]).encode()).hexdigest()[:16]
                if not redo and entry["levels"].get(lv.label, {}).get("fingerprint") == key:
                    continue
                row = calibrate_level(comp, lv, quick, workdir, problems)
                entry["levels"][lv.label] = {**row, "fingerprint": key}
                entry["picked"], entry["why"] = pick_level(entry["levels"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(calibration, indent=1) + "\n")  # after every level: a stopped run keeps it
                print(f"[calibrate] {comp.key} / {lv.label}: greedy {_fmt(row['greedy_success'])}, sampled "
                      f"{_fmt(row['sampled_success'])}, groups varied {_fmt(row['groups_varied'])} ({row['seconds']:.0f} s)",
                      file=sys.stderr, flush=True)
        if calibration.get(comp.key, {}).get("levels"):  # the pick by today's rule, measured now or read from the file
            calibration[comp.key]["picked"], calibration[comp.key]["why"] = pick_level(calibration[comp.key]["levels"])
    calibration = {k: v for k, v in calibration.items() if v.get("levels")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    table = calibration_markdown(calibration, grid)
    if doc is not None:
        write_calibration_doc(doc, table, mode)
    print(table)
    return calibration

"""The HTML page of ``teamrl report``: ``RUN_DIR/report/index.html``, one self-contained page.

The page opens offline: its curves are inline SVG drawn here, its CSS and its few lines of JS
are inline, and it loads nothing. It holds the run's summary, a chart per metric group (and one
per any other per-step metric logged), the latest ``teamrl eval`` (its table, and a transcript
browser: pick a problem, every method's episode side by side, call by call, with the rewards),
and the training episodes of ``RUN_DIR/episodes`` by step. Every text a model wrote (and every
name from a config or a data file) is HTML-escaped: a completion holding ``<script>`` shows as text.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

from teamrl.trainer.report_data import Series, plot_groups, run_workflow, summary, warm_start_note, warm_start_summary


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
MAX_TEXT = 20_000        # characters of one text block on the page (the JSONL files hold all of it)
MAX_STEPS = 12           # training steps whose episodes the page holds: evenly spaced, the first and the last included
MAX_STEP_SAMPLES = 64    # samples of one training step on the page

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0 auto;max-width:1500px;
padding:0 16px 40px;color:#222}
h1{font-size:22px;margin:18px 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}nav a{margin-right:14px}
table{border-collapse:collapse;margin:6px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
thead th{background:#f4f6f8}td.n{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:14px}figure{margin:0;border:1px solid #e3e3e3;padding:6px;background:#fafafa}
figcaption{font-weight:600;margin-bottom:2px}.chart text{font-size:10px;fill:#555}
.legend{font-size:11px;max-width:520px}.legend span{display:inline-block;margin-right:10px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
pre.text{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;border:1px solid #e5e5e5;padding:6px;
margin:4px 0;max-height:420px;overflow:auto;font:12px/1.4 ui-monospace,Menlo,Consolas,monospace}
.scroll{overflow-x:auto}table.transcript{table-layout:fixed}table.transcript td{min-width:340px;width:560px}
.who{font-size:12px;color:#444}.role{font-weight:700;color:#0b5cad}
.reward{font-size:12px;background:#eef7ee;border-left:3px solid #2ca02c;padding:2px 6px;margin:3px 0}
.reward.neg{background:#fbeeee;border-left-color:#d62728}.bad{color:#b00}.ok{color:#070}.meta{color:#555;font-size:12px}
td.wide{min-width:360px;max-width:900px}.msg b{font-size:11px;text-transform:uppercase;color:#666}
select{font-size:14px;max-width:100%}
"""

SCRIPT = """(function(){
function options(sel){var v=[];for(var i=0;i<sel.options.length;i++)v.push(sel.options[i].value);return v;}
function pick(kind,key){var sel=document.getElementById(kind+'-select');if(!sel)return;
if(key!=null&&options(sel).indexOf(key)>=0)sel.value=key;
var all=document.querySelectorAll('section.'+kind);
for(var i=0;i<all.length;i++)all[i].hidden=all[i].getAttribute('data-key')!==sel.value;}
['problem','step'].forEach(function(kind){var sel=document.getElementById(kind+'-select');if(!sel)return;
sel.addEventListener('change',function(){pick(kind);try{history.replaceState(null,'','#'+kind+'='+encodeURIComponent(sel.value));}catch(e){}});});
var m=/^#(problem|step)=(.*)$/.exec(location.hash);
pick('problem',m&&m[1]==='problem'?decodeURIComponent(m[2]):null);pick('step',m&&m[1]==='step'?decodeURIComponent(m[2]):null);
document.documentElement.setAttribute('data-ready','1');})();"""


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _e(value: Any) -> str:
    """``value`` as escaped HTML text (quotes too: safe inside an attribute); control characters, which
    HTML cannot hold, are shown as ``\\xNN``."""
    return html.escape(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value)), quote=True)


def _text(value: Any) -> str:
    """A model's or a data file's text as an escaped ``<pre>``, cut at :data:`MAX_TEXT` characters."""
    text = "" if value is None else str(value)
    more = len(text) - MAX_TEXT
    cut = f"\n... ({more} more characters in the JSONL file)" if more > 0 else ""
    return f'<pre class="text">{_e(text[:MAX_TEXT])}{_e(cut)}</pre>'


def _num(v: Any, digits: int = 3) -> str:
    """A table cell's value: floats to ``digits`` places, booleans as yes/no, None as '-', the rest escaped."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else _e(v)
    return _e(v)


def _tick(v: float, spacing: float) -> str:
    """An axis label of ``v`` with as many decimals as ticks ``spacing`` apart need to differ."""
    if v == 0:
        return "0"
    if spacing <= 0 or not 1e-4 <= max(abs(v), spacing) < 1e6:
        return f"{v:.2e}"
    return f"{v:.{max(0, 1 - math.floor(math.log10(spacing)))}f}"


def svg_chart(series: Series, title: str, width: int = 460, height: int = 220) -> str:
    """An inline SVG line chart of ``series`` against step, and its legend (HTML); '' when nothing is finite."""
    pts = {
        n: [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
        for n, (xs, ys) in series.items()
    }
    pts = {n: p for n, p in pts.items() if p}
    if not pts:
        return ""
    xs = sorted({x for p in pts.values() for x, _ in p})
    ys = [y for p in pts.values() for _, y in p]
    x0, x1, y0, y1 = xs[0], xs[-1], min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    pad = (y1 - y0) * 0.05 if y1 > y0 else (abs(y0) * 0.1 or 1.0)
    y0, y1 = y0 - pad, y1 + pad
    left, right, top, bottom = 58, 10, 8, 30
    pw, ph = width - left - right, height - top - bottom

    def X(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def Y(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * ph

    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'xmlns="http://www.w3.org/2000/svg" role="img"><title>{_e(title)}</title>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#bbb"/>']
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{Y(v) + 3:.1f}" text-anchor="end">{_tick(v, (y1 - y0) / 4)}</text>')
    ticks = xs if len(xs) <= 8 else [xs[round(i * (len(xs) - 1) / 7)] for i in range(8)]
    for x in dict.fromkeys(ticks):
        out.append(f'<text x="{X(x):.1f}" y="{top + ph + 14}" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 2}" text-anchor="middle">step</text>')
    legend = []
    for i, (name, p) in enumerate(pts.items()):
        c = COLOURS[i % len(COLOURS)]
        coords = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in p)
        out.append(
            f'<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{coords}">'
            f'<title>{_e(name)}</title></polyline>'
        )
        if len(p) < 40:
            out += [
                f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="2.2" fill="{c}">'
                f'<title>{_e(name)} step {x:g}: {y:.4g}</title></circle>'
                for x, y in p
            ]
        legend.append(f'<span><i style="background:{c}"></i>{_e(name)}</span>')
    out.append("</svg>")
    return "".join(out) + f'<div class="legend">{"".join(legend)}</div>'


def _figure(series: Series, title: str) -> str:
    chart = svg_chart(series, title)
    return f'<figure><figcaption>{_e(title)}</figcaption>{chart}</figure>' if chart else ""


def _curves(everything: list[dict], workflow: str | None = None) -> str:
    """A chart per :func:`plot_groups` group (every :data:`PLOTS` group and every other family of metrics
    named ``<family>/...``), then, collapsed, one per any other logged per-step metric."""
    figures, covered = [], set()
    for _stem, title, series in plot_groups(everything, workflow):
        covered |= set(series)
        figures.append(_figure(series, title))
    groups: dict[str, list[str]] = {}
    for k in sorted(
        {
            k
            for m in everything
            for k, v in m.items()
            if k != "step" and "/" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        - covered
    ):
        groups.setdefault(k, []).append(k)
    others = [_figure({k: ([m["step"] for m in everything if isinstance(m.get(k), (int, float))],
                           [m[k] for m in everything if isinstance(m.get(k), (int, float))]) for k in keys},
                      group + ("/*" if any("/" in k for k in keys) else "")) for group, keys in groups.items()]
    page = f'<div class="charts">{"".join(figures)}</div>'
    if any(others):
        page += ('<details><summary>every other per-step metric</summary>'
                 f'<div class="charts">{"".join(others)}</div></details>')
    return page


def _read_jsonl(path: Path, limit: int | None = None) -> tuple[list[dict], int]:
    """(the first ``limit`` records of a JSONL file, how many it holds); a line that is not JSON is an
    error naming the file and line."""
    from teamrl.tasks.jsonl import read_jsonl

    records = read_jsonl(path, "teamrl report")
    return (records if limit is None else records[:limit]), len(records)


def _eval_table(results: dict) -> str:
    methods = results["methods"]
    with_pass = any(m.get("pass_at_1") is not None for m in methods.values())
    with_valid = any(m.get("valid") is not None for m in methods.values())
    # a user workflow's return beside the task's reward
    unlike = len({m.get("scored_by", "") for m in methods.values()}) > 1
    head = (
        ["method", "normalised return", "+/- stderr"]
        + (["scored by"] if unlike else [])
        + (["pass@1 / success"] if with_pass else [])
        + (["valid replies"] if with_valid else [])
        + ["problems", "replies / problem", "generated tokens/s", "s / problem"]
    )
    rows = []
    for name, m in methods.items():
        cells = (
            [m.get("mean"), m.get("stderr")]
            + ([m.get("scored_by")] if unlike else [])
            + ([m.get("pass_at_1")] if with_pass else [])
            + ([m.get("valid")] if with_valid else [])
            + [m.get("problems"), m.get("replies_per_problem")]
        )
        speed = [f'{m.get("tokens_per_s", 0):.0f}', f'{m.get("seconds_per_problem", 0):.2f}']
        rows.append(f'<tr><th>{_e(name)}</th>' + "".join(f'<td class="n">{_num(c)}</td>' for c in cells)
                    + "".join(f'<td class="n">{s}</td>' for s in speed) + "</tr>")
    # e.g. the problems were the training problems
    note = next((m["note"] for m in methods.values() if m.get("note")), "")
    if unlike:
        note = (note + " " if note else "") + (
            "The rows are scored by different measures (scored by): their normalised "
            "returns and paired differences do not compare."
        )
    out = ((f'<p class="bad">{_e(note)}</p>' if note else "")
           + f'<table id="eval-table"><thead><tr>{"".join(f"<th>{_e(h)}</th>" for h in head)}</tr></thead>'
           f'<tbody>{"".join(rows)}</tbody></table>')
    keys = list(dict.fromkeys(k for m in methods.values() for k in (m.get("stats") or {})))
    if keys:
        out += (
            '<table id="eval-stats"><thead><tr><th>statistic</th>'
            + "".join(f"<th>{_e(n)}</th>" for n in methods)
            + "</tr></thead><tbody>"
            + "".join(
                f"<tr><th>{_e(k)}</th>"
                + "".join(f'<td class="n">{_num((m.get("stats") or {}).get(k))}</td>' for m in methods.values())
                + "</tr>"
                for k in keys
            )
            + "</tbody></table>"
        )
    import dataclasses

    from teamrl.trainer.evaluate import Comparison, format_comparison  # as report.py: only when there is an eval

    fields = {f.name for f in dataclasses.fields(Comparison)}
    items = [f"<li>{_e(format_comparison(Comparison(**{k: v for k, v in c.items() if k in fields})))}</li>"
             for c in results.get("comparisons", [])]
    if items:
        out += f'<ul id="eval-comparisons">{"".join(items)}</ul>'
    return out


def _messages(messages: Any) -> str:
    if isinstance(messages, str):
        return _text(messages)
    parts = []
    for m in messages or []:
        if isinstance(m, dict):
            parts.append(f'<div class="msg"><b>{_e(m.get("role", "?"))}</b>{_text(m.get("content"))}</div>')
        else:
            parts.append(_text(m))
    return "".join(parts)


def _reward_line(r: dict) -> str:
    who = "team reward" if r.get("role") is None else f"reward of {r['role']}"
    value = r.get("value")
    neg = " neg" if isinstance(value, (int, float)) and value < 0 else ""
    return f'<div class="reward{neg}">{_e(who)}: {_num(value)}</div>'


def _call_cell(call: dict, rewards: Iterable[dict]) -> str:
    n = len(call.get("messages") or []) if not isinstance(call.get("messages"), str) else 1
    facts = [f'turn {_e(call.get("turn"))}', f'policy {_e(call.get("policy"))}',
             f'{_e(call.get("prompt_tokens"))} prompt / {_e(call.get("completion_tokens"))} completion tokens',
             f'ends: {_e(call.get("finish_reason"))}']
    if call.get("own_reward") is not None:
        facts.append(f'own reward {_num(call["own_reward"])}')
    if call.get("valid") is not None:
        facts.append(
            '<span class="ok">valid reply</span>' if call["valid"] else '<span class="bad">not a valid reply</span>'
        )
    return (
        f'<div class="call"><div class="who"><span class="role">{_e(call.get("role"))}</span> · '
        + " · ".join(facts)
        + f'</div><details><summary>prompt ({n} message{"s" if n != 1 else ""})</summary>'
        f'{_messages(call.get("messages"))}'
        f'</details>{_text(call.get("completion"))}{"".join(_reward_line(r) for r in rewards)}</div>'
    )


def _outcome_cell(e: dict, rewards: Iterable[dict]) -> str:
    lines = [f'score (normalised return) <b>{_num(e.get("score"))}</b>', f'team return {_num(e.get("team_return"))}',
             f'final team reward {_num(e.get("final_reward"))}']
    if e.get("correct") is not None:
        lines.append('<span class="ok">correct</span>' if e["correct"] else '<span class="bad">not correct</span>')
    out = "".join(_reward_line(r) for r in rewards) + " · ".join(lines)
    o = e.get("outcome")
    if o:
        out += f'<div class="meta">answer: {_e(o.get("answer"))}</div>'
        stats = o.get("stats") or {}
        if stats:
            out += (
                "<table>"
                + "".join(f"<tr><th>{_e(k)}</th><td>{_e(json.dumps(v))}</td></tr>" for k, v in stats.items())
                + "</table>"
            )
        out += f'<details><summary>final text</summary>{_text(o.get("final_text"))}</details>'
    elif e.get("returned") is not None:
        out += f'<div class="meta">returned: {_e(json.dumps(e["returned"]))}</div>'
    return out


def _transcripts(results_file: Path, results: dict) -> str:
    """The eval transcript browser: a problem picker, then every method's episode side by side, call by call."""
    episodes: dict[str, dict[Any, dict]] = {}
    missing = []
    for name, m in results["methods"].items():
        path = results_file.parent / Path(m.get("episodes_file") or f"{name}.jsonl").name  # beside results.json only
        if not path.is_file():
            missing.append(path.name)
            continue
        episodes[name] = {json.dumps(e["problem_id"]): e for e in _read_jsonl(path)[0]}
    if not episodes:
        return f'<p>No transcripts: {_e(", ".join(missing))} not found beside results.json.</p>'
    methods = sorted(episodes, key=lambda n: (n != "team", n != "untrained"))  # trained, untrained, then the baselines
    problems = list(dict.fromkeys(k for n in methods for k in episodes[n]))
    options, sections = [], []
    for i, key in enumerate(problems):
        pid = json.loads(key)
        scores = ", ".join(f'{n} {_num(episodes[n][key].get("score"), 2)}' for n in methods if key in episodes[n])
        options.append(f'<option value="{i}">{_e(pid)}: {scores}</option>')
        eps = [episodes[n].get(key) for n in methods]
        depth = max(len(e["calls"]) for e in eps if e)
        head = "".join(f'<th>{_e(n)}<div class="meta">score {_num(e.get("score")) if e else "-"}</div></th>'
                       for n, e in zip(methods, eps))
        body = []
        for k in range(depth):
            cells = []
            for e in eps:
                if e is None or k >= len(e["calls"]):
                    cells.append("<td></td>")
                    continue
                call = e["calls"][k]
                last_of_call = k + 1 == len(e["calls"]) or e["calls"][k + 1].get("call") != call.get("call")
                rewards = [r for r in e.get("rewards", []) if last_of_call and r.get("after_call") == call.get("call")
                           and r.get("after_call") is not None]
                cells.append(f"<td>{_call_cell(call, rewards)}</td>")
            body.append(f"<tr><th>call {k}</th>{''.join(cells)}</tr>")
        body.append(
            "<tr><th>outcome</th>"
            + "".join(
                "<td></td>"
                if e is None
                else f'<td>{_outcome_cell(e, [r for r in e.get("rewards", []) if r.get("after_call") is None])}</td>'
                for e in eps
            )
            + "</tr>"
        )
        sections.append(
            f'<section class="problem" data-key="{i}"{"" if i == 0 else " hidden"}><h3>problem {_e(pid)}</h3>'
            f'<div class="scroll"><table class="transcript"><thead><tr><th></th>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div></section>'
        )
    note = f'<p class="meta">Missing: {_e(", ".join(missing))}</p>' if missing else ""
    return (
        f'<p><label>problem <select id="problem-select">{"".join(options)}</select></label> '
        f'<span class="meta">{len(problems)} problems; each method\'s episode of the chosen one side by side</span></p>'
        + note
        + "".join(sections)
    )


def _training_episodes(run_dir: Path) -> str:
    """The training episodes of ``RUN_DIR/episodes/step_*.jsonl``: a step picker, then each problem's samples."""
    files = sorted(
        (p for p in (run_dir / "episodes").glob("step_*.jsonl") if p.stem[5:].isdigit()), key=lambda p: int(p.stem[5:])
    )
    if not files:
        return '<p>No training episodes (<code>run.log_episodes</code> was off).</p>'
    shown = (
        files
        if len(files) <= MAX_STEPS
        else [files[round(i * (len(files) - 1) / (MAX_STEPS - 1))] for i in range(MAX_STEPS)]
    )
    shown = list(dict.fromkeys(shown))
    options, sections = [], []
    for j, path in enumerate(shown):
        step = int(path.stem[5:])
        records, n = _read_jsonl(path, MAX_STEP_SAMPLES)
        options.append(f'<option value="{step}">step {step} ({n} samples)</option>')
        by_problem: dict[str, list[dict]] = {}
        for r in records:
            by_problem.setdefault(json.dumps(r.get("problem_id")), []).append(r)
        parts = [
            f'<p class="meta">{path.name}: {n} samples'
            + (f", the first {len(records)} shown" if n > len(records) else "")
            + "</p>"
        ]
        for key, rs in by_problem.items():
            prompts = list(dict.fromkeys(r.get("prompt", "") for r in rs))
            rows = []
            for r in rs:
                cells = [
                    r.get("episode"),
                    r.get("role"),
                    r.get("turn"),
                    r.get("branch"),
                    r.get("policy"),
                    r.get("reward"),
                    r.get("advantage"),
                    r.get("trainable"),
                    r.get("completion_tokens"),
                ]
                rows.append(
                    "<tr>"
                    + "".join(f'<td class="n">{_num(c)}</td>' for c in cells)
                    + f'<td class="n">#{prompts.index(r.get("prompt", "")) + 1}</td>'
                    f'<td class="wide">{_text(r.get("completion"))}</td></tr>'
                )
            parts.append(
                f'<h3>problem {_e(json.loads(key))}</h3><details><summary>{len(prompts)} distinct prompt(s)</summary>'
                + "".join(f"<div class=\"msg\"><b>#{i + 1}</b>{_text(p)}</div>" for i, p in enumerate(prompts))
                + "</details>"
                "<table><thead><tr><th>episode</th><th>role</th><th>turn</th><th>branch</th><th>policy</th><th>reward</th>"
                "<th>advantage</th><th>trained</th><th>tokens</th><th>prompt</th><th>completion</th></tr></thead><tbody>"
                + "".join(rows)
                + "</tbody></table>"
            )
        sections.append(
            f'<section class="step" data-key="{step}"{"" if j == len(shown) - 1 else " hidden"}>'
            f'{"".join(parts)}</section>'
        )
    note = f" ({len(shown)} of {len(files)} steps, evenly spaced)" if len(shown) < len(files) else ""
    options[-1] = options[-1].replace("<option ", "<option selected ", 1)
    return (f'<p><label>training step <select id="step-select">{"".join(options)}</select></label>'
            f'<span class="meta">{_e(note)}</span></p>' + "".join(sections))


def render_html(run_dir: Path, everything: list[dict], results_file: Path | None, results: dict | None) -> str:
    """The self-contained report page (see the module docstring)."""
    import base64
    import hashlib

    from teamrl.core.metrics import accuracy_summary, training_records

    metrics = training_records(everything)
    if not metrics:  # a warm start only (teamrl sft, before teamrl train --resume): say what the run holds
        top = f'<p id="run-summary">{_e(warm_start_note(run_dir) or "No training step yet.")}</p>'
    else:
        main, k, first, last, secs = summary(metrics)
        top = (
            f'<table id="run-summary"><thead><tr><th>steps</th><th>{_e(main)}, first {k}</th>'
            f'<th>{_e(main)}, last {k}</th><th>seconds per step</th></tr></thead><tbody><tr>'
            f'<td class="n">{len(metrics)}</td><td class="n">{_num(first)}</td>'
            f'<td class="n">{_num(last)}</td><td class="n">{secs:.1f}</td></tr></tbody></table>'
        )
        warm = warm_start_summary(run_dir, everything)
        if warm:
            top += f'<p id="warm-start">{_e(warm)}</p>'
    acc = accuracy_summary(everything)
    if acc:
        top += (
            '<table><thead><tr><th>held-out accuracy: first</th><th>peak (step)</th><th>final</th>'
            '<th>cliffs at steps</th>'
            f'</tr></thead><tbody><tr><td class="n">{_num(acc["untrained"])}</td><td class="n">{_num(acc["peak"])} '
            f'({acc["peak_step"]})</td><td class="n">{_num(acc["final"])}</td>'
            f'<td>{_e(", ".join(map(str, acc["cliffs"])) or "none")}'
            f'</td></tr></tbody></table>'
        )
    if results is None or results_file is None:
        eval_table = ('<p>No eval yet: <code>teamrl eval --checkpoint RUN_DIR task.split=test</code> writes one under '
                      '<code>RUN_DIR/eval/</code>, and the next <code>teamrl report</code> shows it here.</p>')
        transcripts = "<p>No eval yet.</p>"
    else:
        problems = results.get("problems") or {}
        held = {True: "held out", False: "the training problems", None: "held out or not: unknown"}[
            problems.get("held_out")
        ]
        meta = [f'{_e(results_file.parent.name)}', f'command <code>{_e(results.get("command"))}</code>',
                f'checkpoint {_e(results.get("checkpoint_step") or "none (base model)")}',
                f'problems: {_e(problems.get("description") or held)}', f'temperature {_e(results.get("temperature"))}']
        eval_table = f'<p class="meta">{" · ".join(meta)}</p>{_eval_table(results)}'
        transcripts = _transcripts(results_file, results)
    script_hash = base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    # no network and no script but ours: an escaping slip still could not run a model's text as code
    csp = f"default-src 'none'; style-src 'unsafe-inline'; img-src data:; script-src 'sha256-{script_hash}'"
    name = _e(run_dir.resolve().name)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>teamrl report: {name}</title>'
        f'<style>{CSS}</style></head><body><h1>teamrl report: {name}</h1>'
        '<nav><a href="#summary">summary</a><a href="#eval">eval</a><a href="#curves">curves</a>'
        '<a href="#transcripts">eval transcripts</a><a href="#episodes">training episodes</a></nav>'
        f'<h2 id="summary">Summary</h2>{top}<h2 id="eval">Latest eval</h2>{eval_table}'
        f'<h2 id="curves">Curves</h2>{_curves(everything, run_workflow(run_dir))}'
        f'<h2 id="transcripts">Eval transcripts</h2>{transcripts}'
        f'<h2 id="episodes">Training episodes</h2>{_training_episodes(run_dir)}'
        f'<script>{SCRIPT}</script></body></html>\n'
    )

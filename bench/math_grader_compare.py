"""Where teamrl's old hand-written math grader and math-verify disagree (issue 35, item 4).

Grades, with both graders, the gold answers of MATH-500 and GSM8K against themselves, against
reformatted variants of themselves and against wrong answers, each written as a model would
write it (a reply ending in ``\\boxed{}`` or an ``Answer:`` line: teamrl's extraction, the same
for both graders, reads the answer out first). Every pair has a kind and, where it is clear, the
right verdict (``expect``: same value or not); the table counts each kind's pairs, where the
graders disagree, and how often each is right.

- old: ``answers_equal`` of ``teamrl/tasks/math_env.py`` at ``--old-ref`` (read from git; the
  loader's ``normalize_answer`` applied to the gold, as its loaders did);
- new: ``teamrl.tasks.math_env.grade_answer`` (math-verify's parse + verify, the gold as gold).

The data sets are not part of the repository: pass their paths (docs/data.md).

Usage: python bench/math_grader_compare.py --math500 DATA/math/math500.jsonl \\
           --gsm8k DATA/gsm8k/test.jsonl [--limit N] [--examples 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import ModuleType

OLD_REF = "e3c7283d614f01efef22997a4cbd086eb5490b9a"  # the last commit with the hand-written grader
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Pair:
    """One comparison: a model reply (or a bare answer) against a gold answer."""

    source: str  # math500 or gsm8k
    kind: str  # how the reply was made from the gold (see variants())
    gold: str  # the data set's answer, as stored
    reply: str  # the model-style text; teamrl's extraction reads the answer out of it
    expect: bool | None  # the right verdict where it is clear; None: a judgement call


def load_old_grader(ref: str) -> ModuleType:
    """``teamrl/tasks/math_env.py`` as it was at git ``ref``, imported as its own module."""
    try:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:teamrl/tasks/math_env.py"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--old-ref {ref}: cannot read teamrl/tasks/math_env.py from git ({e}); "
                         "run inside a clone that has that commit") from None
    spec = importlib.util.spec_from_loader("teamrl_old_math_env", loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module.__name__] = module  # dataclasses look their module up here
    exec(compile(text, f"{ref[:7]}:teamrl/tasks/math_env.py", "exec"), module.__dict__)  # our own source, from git
    return module


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- model-style variants of a gold answer ------------------------------------------------------

_INT = re.compile(r"^-?\d+$")
_DEC = re.compile(r"^-?\d*\.\d+$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}$")


def number_of(gold: str) -> Fraction | None:
    """The exact value of an integer, decimal or ``\\frac{p}{q}`` gold; None for anything else."""
    s = gold.strip().replace("{,}", "")
    if _INT.match(s) or _DEC.match(s):
        return Fraction(s)
    m = _FRAC.match(s)
    if m and int(m.group(3)):
        return Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    return None


def decimal_text(x: Fraction, places: int) -> str | None:
    """``x`` written with at most ``places`` decimals when that is exact, else None."""
    scaled = x * 10 ** places
    if scaled.denominator != 1:
        return None
    s = f"{abs(scaled.numerator) // 10 ** places}.{abs(scaled.numerator) % 10 ** places:0{places}d}".rstrip("0").rstrip(".")
    return ("-" if x < 0 else "") + s


def same_value(a: str, b: str) -> bool:
    """Whether two golds are plainly the same value (same text, or the same number)."""
    return re.sub(r"\s", "", a) == re.sub(r"\s", "", b) or (number_of(a) is not None and number_of(a) == number_of(b))


def plain(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"\\frac{{{x.numerator}}}{{{x.denominator}}}"


def split_top(s: str) -> list[str]:
    """``s`` split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in parts + [cur]]


def variants(gold: str, other: str) -> list[tuple[str, str, bool | None]]:
    """(kind, reply, expect) pairs for ``gold``; ``other`` is another problem's gold (a wrong answer)."""
    g = gold.strip()
    out: list[tuple[str, str, bool | None]] = [
        ("same text", g, True),
        ("\\boxed{} reply", f"Adding these up gives the result, so the answer is $\\boxed{{{g}}}$.", True),
        ("Answer: line", f"Step 1: work it out.\nAnswer: {g}", True),
        ("Answer: $...$", f"**Answer:** ${g}$", True),
        ("no spaces", re.sub(r"\s+", "", g), True),
        ("another problem's answer", other, None if same_value(other, g) else False),
    ]
    if "\\frac" in g:
        out.append(("\\dfrac", g.replace("\\frac", "\\dfrac"), True))
    if "\\left" in g or "\\right" in g:
        out.append(("no \\left \\right", re.sub(r"\\(?:left|right)\s*", "", g), True))
    text = re.fullmatch(r"\\text\{\s*([^{}]*?)\s*\}", g)
    if text:
        out += [("\\text{} dropped", text.group(1), True), ("\\text{} lower case", text.group(1).lower(), True)]
    x = number_of(g)
    if x is not None:
        dec = decimal_text(x, 6)
        if dec is not None and dec != g:
            out.append(("as a decimal", dec, True))
        elif dec is None:
            out.append(("rounded to 2 decimals", f"{float(x):.2f}", False))
            out.append(("rounded to 6 decimals", f"{float(x):.6f}", None))
        if x.denominator != 1 or "." in g:
            out.append(("as a fraction", plain(x), True))
        if x.denominator == 1:
            out.append(("integer as n.0", f"{x.numerator}.0", True))
            if abs(x) >= 1000:
                out.append(("thousands separators", f"{x.numerator:,}", True))
        out += [
            ("x = value", f"x = {g}", True),
            ("unit in \\text{}", f"{g}\\text{{ cm}}", True),
            ("unit word", f"{dec or g} dollars", True),
            ("currency sign", f"\\${g}", True),
            # math-verify reads n% as n for an integer n >= 0 only; for a fraction the right verdict
            # depends on the question (a percentage asked for, or not)
            ("percent sign", f"{g}\\%", True) if x.denominator == 1 and x >= 0 else ("percent sign on a fraction or below 0", f"{g}\\%", None),
            ("degrees", f"{g}^\\circ", True),
            ("off by one", plain(x + 1), False),
        ]
        if x != 0:
            out += [("times ten", plain(x * 10), False), ("sign flipped", plain(-x), False)]
    inner = re.sub(r"^\\left\s*", "", g)
    if re.match(r"^[(\[]", inner) and re.search(r"[)\]]$", g) and len(split_top(re.sub(r"^[(\[]|[)\]]$", "", re.sub(r"\\right\s*(?=[)\]]$)", "", inner)))) == 2:
        body = split_top(re.sub(r"^[(\[]|[)\]]$", "", re.sub(r"\\right\s*(?=[)\]]$)", "", inner)))
        opening, closing = inner[0], g[-1]
        swapped = f"{opening}{body[1]}, {body[0]}{closing}"
        if body[0] != body[1]:
            out.append(("pair in the other order", swapped, False))
        flip = {"(": "[", "[": "("}[opening] + f"{body[0]}, {body[1]}" + {")": "]", "]": ")"}[closing]
        out.append(("other bracket (open/closed)", flip, False))  # a point or an interval: wrong either way
    elif "," in g and not re.search(r"[()\[\]{}$]|\\!|^-?\d{1,3}(,\d{3})+$", g):  # not 1,000 or \$32,\!348
        parts = split_top(g)
        if len(parts) > 1 and len(set(parts)) == len(parts):
            out.append(("list in another order", ", ".join(reversed(parts)), True))
    return out


def make_pairs(math500: list[dict], gsm8k: list[dict]) -> list[Pair]:
    pairs = []
    golds = [str(r["answer"]) for r in math500]
    for i, g in enumerate(golds):
        for kind, reply, expect in variants(g, golds[(i + 7) % len(golds)]):
            pairs.append(Pair("math500", kind, g, reply, expect))
    finals = [str(r["answer"]).rsplit("####", 1)[1].strip() for r in gsm8k]
    for i, g in enumerate(finals):
        for kind, reply, expect in variants(g, finals[(i + 7) % len(finals)]):
            pairs.append(Pair("gsm8k", kind, g, reply, expect))
        pairs.append(Pair("gsm8k", "The answer is N", g, f"She makes {g} every day. The answer is {g}.", True))
        pairs.append(Pair("gsm8k", "value with .00", g, f"Answer: ${g}.00", True))
    return pairs


# --- grading ------------------------------------------------------------------------------------


def grade_all(pairs: list[Pair], old: ModuleType) -> tuple[list[bool], list[bool], float, float, float]:
    """(old verdicts, new verdicts, old seconds, new seconds, new seconds per pair with no parse
    cached: every 10th pair); extraction is timed with each."""
    from teamrl.tasks import math_env as new

    def old_one(p: Pair) -> bool:
        a = old.extract_answer(p.reply) or p.reply
        return bool(old.answers_equal(a, old.normalize_answer(p.gold)))

    def new_one(p: Pair) -> bool:
        a = new.extract_answer(p.reply) or p.reply
        return bool(new.grade_answer(a, new.answer_text(p.gold)))

    new_one(Pair("warm", "", "1", "1", True)), old_one(Pair("warm", "", "1/2", "0.5", True))  # imports
    t = time.perf_counter()
    old_v = [old_one(p) for p in pairs]
    t_old = time.perf_counter() - t
    t = time.perf_counter()
    new_v = [new_one(p) for p in pairs]
    t_new = time.perf_counter() - t
    sample = pairs[::10]
    t = time.perf_counter()
    for p in sample:
        new._parsed.cache_clear()
        new_one(p)
    return old_v, new_v, t_old, t_new, (time.perf_counter() - t) / max(1, len(sample))


def table(pairs: list[Pair], old_v: list[bool], new_v: list[bool], examples: int) -> str:
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0] * 7)
    shown: dict[tuple[str, str], list[str]] = defaultdict(list)
    for p, o, n in zip(pairs, old_v, new_v):
        r = rows[(p.source, p.kind)]
        r[0] += 1
        r[1] += o
        r[2] += n
        r[3] += o and not n
        r[4] += n and not o
        if p.expect is not None:
            r[5] += o == p.expect
            r[6] += n == p.expect
        if o != n and len(shown[(p.source, p.kind)]) < examples:
            shown[(p.source, p.kind)].append(f"`{p.reply if len(p.reply) < 60 else p.reply[:57] + '...'}` vs gold "
                                             f"`{p.gold}`: old {'=' if o else '!='}, new {'=' if n else '!='}")
    lines = ["| data | kind | expect (-: a judgement call, not counted as right or wrong) | pairs | old equal | new equal | old only | new only | old right | new right |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    expects: dict[tuple[str, str], set] = defaultdict(set)
    for p in pairs:
        expects[(p.source, p.kind)].add(p.expect)
    totals = [0] * 7
    for key in sorted(rows, key=lambda k: (k[0] != "math500", k[1])):
        r = rows[key]
        e = "/".join({True: "equal", False: "unequal", None: "-"}[x] for x in sorted(expects[key], key=str))
        right = (f"{r[5]}", f"{r[6]}") if expects[key] != {None} else ("-", "-")
        lines.append(f"| {key[0]} | {key[1]} | {e} | {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {right[0]} | {right[1]} |")
        totals = [a + b for a, b in zip(totals, r)]
    lines.append(f"| all | | | {totals[0]} | {totals[1]} | {totals[2]} | {totals[3]} | {totals[4]} | {totals[5]} | {totals[6]} |")
    ex = ["", "Disagreements (up to %d per kind):" % examples, ""]
    for key in sorted(shown):
        for s in shown[key]:
            ex.append(f"- {key[0]}, {key[1]}: {s}")
    return "\n".join(lines + ex)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--math500", required=True, help="MATH-500 JSONL (problem, answer)")
    ap.add_argument("--gsm8k", required=True, help="GSM8K test JSONL (question, answer with ####)")
    ap.add_argument("--limit", type=int, default=0, help="first N problems of each file (0 = all)")
    ap.add_argument("--examples", type=int, default=3, help="disagreements shown per kind")
    ap.add_argument("--old-ref", default=OLD_REF, help="git commit holding the old grader")
    ap.add_argument("--out", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    for name in ("math500", "gsm8k"):
        if not Path(getattr(args, name)).is_file():
            print(f"--{name} {getattr(args, name)}: no such file (see docs/data.md)", file=sys.stderr)
            return 2
    sys.path.insert(0, str(ROOT))
    old = load_old_grader(args.old_ref)
    m, g = read_jsonl(args.math500), read_jsonl(args.gsm8k)
    if args.limit:
        m, g = m[:args.limit], g[:args.limit]
    pairs = make_pairs(m, g)
    old_v, new_v, t_old, t_new, t_cold = grade_all(pairs, old)
    report = table(pairs, old_v, new_v, args.examples)
    n = len(pairs)
    report += (f"\n\n{n} pairs ({len(m)} MATH-500 and {len(g)} GSM8K golds); grading time per pair, extraction "
               f"included: old {1e3 * t_old / n:.2f} ms, new {1e3 * t_new / n:.2f} ms (a parse cached per text, as in "
               f"training), new with nothing cached {1e3 * t_cold:.2f} ms (every 10th pair).\n")
    print(report)
    if args.out:
        Path(args.out).write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

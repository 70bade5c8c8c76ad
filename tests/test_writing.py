"""writing.tldr / writing.expand: offline data, loaders, the level rewards at their boundaries."""

from __future__ import annotations

import itertools
import json
import socket

import pytest

import teamrl.tasks.writing as W
from teamrl.core.config import ConfigError, build_dataclass
from teamrl.tasks.task import Problem
from teamrl.tasks.writing import (WritingExpand, WritingExpandOptions, WritingTLDR, WritingTLDROptions,
                                  load_papers)


def words(n: int, prefix: str = "w") -> str:
    """n distinct non-stopword words: w0 w1 ... (full vocabulary credit, no transitions)."""
    return " ".join(f"{prefix}{i}" for i in range(n))


@pytest.fixture(scope="module")
def tldr() -> WritingTLDR:
    return WritingTLDR()


@pytest.fixture(scope="module")
def expand() -> WritingExpand:
    return WritingExpand()


P = Problem("t:0", {"abstract": "unused by tldr"})

# A hand-made ideal pair: in bounds, ratio in band, rich vocabulary, two transitions,
# 7 of the TL;DR's 11 content words reused by the summary (overlap 0.64).
IDEAL_TLDR = ("SparseAlign is a fast word alignment model that improves translation quality for "
              "low-resource language pairs.")
IDEAL_SUMMARY = ("Word alignment is a key step for machine translation, but existing aligners are slow and need "
                 "large parallel corpora. This paper introduces SparseAlign, which learns sparse attention between "
                 "source and target tokens. Moreover, it distils a multilingual encoder into a compact student "
                 "network. As a result, training takes minutes on one processor. Experiments on six language pairs "
                 "show lower alignment error rates, and downstream translation gains reach three BLEU points for "
                 "low-resource settings.")
BACKGROUND = ("Named entity recognition for historical newspapers remains difficult because optical character "
              "recognition introduces noisy spellings. Moreover, annotated historical corpora are scarce, so models "
              "trained on modern news transfer poorly. However, digitised archives contain millions of unlabelled "
              "pages that could support adaptation. Reliable entity tags would help historians search and link "
              "these archives at scale.")
METHOD = ("We pretrain a character-aware language model on noisy archive text and fine-tune it with a small set of "
          "annotated historical pages. As a result, the tagger learns robust representations of corrupted "
          "spellings. On three historical newspaper benchmarks, our approach improves entity F1 by six points over "
          "modern-news baselines and halves errors on rare entity types.")
ABSTRACT = Problem("t:1", {"abstract": BACKGROUND + " " + METHOD})
UNRELATED_BG = ("Sourdough bread rises slowly because wild yeast ferments flour at cool kitchen temperatures, "
                "giving bakers a crust with deep flavour. Home bakers often feed starters daily with rye and water "
                "to keep cultures lively during winter months and busy weeks.")
UNRELATED_METHOD = ("Mix dough by hand, rest it overnight inside a cold fridge, then shape loaves gently and bake "
                    "them in a preheated cast iron pot until golden, crisp and hollow sounding when tapped "
                    "underneath with your knuckles after roughly forty minutes.")


# ------------------------------------------------------------------ data


def test_aclsum_loads_250_papers_offline(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("load_papers tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    papers = load_papers()
    assert len(papers) == 250 and len({p["id"] for p in papers}) == 250
    for p in papers:
        for key in ("id", "title", "abstract", "introduction", "conclusion"):
            assert isinstance(p[key], str) and p[key].strip(), (p["id"], key)
        assert set(p["summaries"]) == {"challenge", "approach", "outcome"}
        assert all(s.strip() for s in p["summaries"].values()), p["id"]
        assert " , " not in p["introduction"]  # the package's tokenised text was turned back into prose
    assert [len(load_papers(split=s)) for s in ("train", "val", "test")] == [100, 50, 100]
    assert [p["id"] for p in load_papers(limit=3)] == [p["id"] for p in papers[:3]]
    with pytest.raises(ValueError, match=r"'dev'.*train.*val.*test"):
        load_papers(split="dev")


def _rec(i: int) -> dict:
    return {"id": f"p{i}", "title": f"Title {i}", "abstract": f"Abstract {i}.", "introduction": f"Intro {i}.",
            "conclusion": f"Conclusion {i}.", "summaries": {"challenge": "c", "approach": "a", "outcome": "o"}}


def test_jsonl_round_trip_and_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    recs = [_rec(0), _rec(1)]
    raw = dict(recs[1], introduction=["Intro", "1."])  # sections may be lists of sentences, as in aclsum
    path.write_text(json.dumps(recs[0]) + "\n\n" + json.dumps(raw) + "\n")
    assert load_papers(str(path)) == [recs[0], dict(recs[1], introduction="Intro 1.")]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_rec(0)) + "\n" + json.dumps({k: v for k, v in _rec(1).items() if k != "conclusion"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: missing field\(s\) \['conclusion'\]"):
        load_papers(str(bad))
    no_outcome = dict(_rec(0), summaries={"challenge": "c", "approach": "a"})
    bad.write_text(json.dumps(no_outcome) + "\n")
    with pytest.raises(ValueError, match=r"line 1: .*summaries\.outcome"):
        load_papers(str(bad))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_papers(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="split"):
        load_papers(str(path), split="train")

    task = WritingExpand(build_dataclass(WritingExpandOptions, {"name": "writing.expand", "source": str(path)}))
    assert [p.id for p in task.problems()] == ["mine:p0", "mine:p1"]
    with pytest.raises(ValueError, match=r"num_problems=3 .* 2 papers"):
        WritingTLDR(WritingTLDROptions(source=str(path), num_problems=3))


def test_hub_name_without_datasets_says_what_to_do(monkeypatch):
    monkeypatch.setattr(W, "_datasets_available", lambda: False)
    with pytest.raises(ImportError, match=r"'someone/papers'.*pip install datasets.*\.jsonl"):
        load_papers("someone/papers")


def test_options_subset_and_validation():
    opts = build_dataclass(WritingTLDROptions, {"name": "writing.tldr", "num_problems": 5, "seed": 1})
    ids = [p.id for p in WritingTLDR(opts).problems()]
    all_ids = [p.id for p in WritingTLDR().problems()]
    assert len(ids) == 5 and all(i.startswith("aclsum:") for i in ids)
    assert ids == [i for i in all_ids if i in ids]  # a sample, kept in data order
    assert ids == [p.id for p in WritingTLDR(opts).problems()]  # same seed, same sample
    with pytest.raises(ValueError, match=r"task\.tldr_min_words=50 > task\.tldr_max_words=40"):
        WritingTLDR(WritingTLDROptions(tldr_min_words=50))
    with pytest.raises(ConfigError, match=r"task\.overlap_max: 1\.5 is out of range"):
        build_dataclass(WritingTLDROptions, {"overlap_max": 1.5}, "task.")


# ------------------------------------------------------------------ level 1: structure gate


@pytest.mark.parametrize("n_tldr,n_summary,ok", [
    (5, 60, True), (4, 60, False), (40, 250, True), (41, 250, False),
    (10, 59, False), (10, 251, False), (0, 100, False), (10, 0, False),
])
def test_tldr_structure_bounds_gate(tldr, n_tldr, n_summary, ok):
    b = tldr.reward_breakdown(P, {"tldr": words(n_tldr), "summary": words(n_summary, "s")})
    assert list(b) == ["structure", "length_ratio", "vocabulary", "style"]
    assert b["structure"] == (1.0 if ok else 0.0)
    if not ok:  # the gate: nothing after level 1 is scored
        assert sum(b.values()) == 0.0
    else:
        assert b["vocabulary"] == 1.0  # distinct words: later levels are scored


@pytest.mark.parametrize("n_bg,ok", [(40, True), (39, False), (150, True), (151, False)])
def test_expand_structure_bounds(expand, n_bg, ok):
    n_method = max(40, min(150, n_bg))
    b = expand.reward_breakdown(ABSTRACT, {"background": words(n_bg), "method": words(n_method, "m")})
    assert b["structure"] == (1.0 if ok else 0.0)
    assert (sum(b.values()) > 1.0) == ok


def test_punctuation_only_output_is_empty(tldr):
    assert tldr.reward(P, {"tldr": " ... , !", "summary": words(100)}) == 0.0


# ------------------------------------------------------------------ level 2: length ratio


@pytest.mark.parametrize("n_tldr,n_summary,credit", [
    (30, 60, 1.0),                   # ratio 2.0: lower edge, inside
    (10, 100, 1.0),                  # 10.0: upper edge, inside
    (10, 101, (20 - 10.1) / 10),     # 10.1: just outside, falls to 0 at 2 * 10 = 20
    (10, 150, 0.5),                  # 15
    (40, 60, 0.5),                   # 1.5: falls to 0 at 2 / 2 = 1
    (12, 250, 0.0),                  # 20.8: beyond the zero point
])
def test_tldr_ratio_band(tldr, n_tldr, n_summary, credit):
    b = tldr.reward_breakdown(P, {"tldr": words(n_tldr), "summary": words(n_summary, "s")})
    assert b["structure"] == 1.0
    assert b["length_ratio"] == pytest.approx(credit)


@pytest.mark.parametrize("n_bg,n_method,credit", [
    (100, 70, 1.0), (100, 69, (0.69 - 0.35) / 0.35), (100, 42, 0.2),
    (50, 70, 1.0), (50, 71, (2.8 - 1.42) / 1.4),
])
def test_expand_ratio_band(expand, n_bg, n_method, credit):
    b = expand.reward_breakdown(ABSTRACT, {"background": words(n_bg), "method": words(n_method, "m")})
    assert b["length_ratio"] == pytest.approx(credit)


# ------------------------------------------------------------------ level 3: vocabulary


def test_mattr_by_hand():
    assert W.mattr([]) == 0.0
    assert W.mattr(["a", "b", "a", "c"], window=3) == pytest.approx((2 / 3 + 3 / 3) / 2)
    assert W.mattr(["a", "b", "a", "c"], window=4) == 0.75  # not longer than the window: plain TTR


def test_vocabulary_level(tldr):
    half = " ".join(f"w{i} w{i}" for i in range(5))  # 10 words, 5 distinct: TTR 0.5
    b = tldr.reward_breakdown(P, {"tldr": half, "summary": words(60, "s")})
    assert b["vocabulary"] == pytest.approx(0.5 * (0.5 - 0.4) / 0.3 + 0.5)
    loop = " ".join(["alpha beta"] * 40)  # 80 words, 2 distinct per 25-word window: no credit
    b = tldr.reward_breakdown(P, {"tldr": words(10), "summary": loop})
    assert b["vocabulary"] == pytest.approx(0.5)


# ------------------------------------------------------------------ level 4: style


@pytest.mark.parametrize("summary_extra,trans", [
    ("", 0.0), ("however", 0.25), ("however however", 0.25), ("however as a result", 0.5),
    ("in contrast moreover thus", 0.5), ("as a", 0.0),
])
def test_transitions(tldr, summary_extra, trans):
    summary = words(60, "s") + " " + summary_extra
    b = tldr.reward_breakdown(P, {"tldr": words(10), "summary": summary})
    # overlap is 0 here (no shared content words), so style is the transition half alone
    assert b["style"] == pytest.approx(trans)


@pytest.mark.parametrize("n_tldr,shared,credit", [
    (10, 5, 1.0),           # 0.5 inside [0.3, 0.9]
    (10, 3, 1.0),           # 0.3: the lower edge
    (10, 2, 0.2 / 0.3),     # below: linear from 0 at 0
    (10, 9, 1.0),           # 0.9: the upper edge
    (10, 10, 0.0),          # every TL;DR word copied into the summary
    (20, 19, 0.05 / 0.1),   # 0.95: linear down to 0 at 1
])
def test_content_overlap_band(tldr, n_tldr, shared, credit):
    summary = words(shared) + " " + words(80, "s")
    b = tldr.reward_breakdown(P, {"tldr": words(n_tldr), "summary": summary})
    assert b["style"] == pytest.approx(0.5 * credit)


# ------------------------------------------------------------------ totals, level 5, vectorised


def test_ideal_pair_reaches_max(tldr, expand):
    b = tldr.reward_breakdown(P, {"tldr": IDEAL_TLDR, "summary": IDEAL_SUMMARY})
    assert b == {"structure": 1.0, "length_ratio": 1.0, "vocabulary": 1.0, "style": 1.0}
    assert tldr.reward(P, {"tldr": IDEAL_TLDR, "summary": IDEAL_SUMMARY}) == tldr.max_reward == 4.0
    assert expand.max_reward == 6.0
    assert expand.reward(ABSTRACT, {"background": BACKGROUND, "method": METHOD}) == pytest.approx(6.0)
    assert tldr.feedback(P, {"tldr": IDEAL_TLDR, "summary": IDEAL_SUMMARY}, 4.0).startswith("All checks passed")


def test_abstract_overlap(expand):
    same = expand.reward_breakdown(ABSTRACT, {"background": BACKGROUND, "method": METHOD})
    assert same["abstract_overlap"] == pytest.approx(2.0)
    other = expand.reward_breakdown(ABSTRACT, {"background": UNRELATED_BG, "method": UNRELATED_METHOD})
    assert other["structure"] == 1.0 and other["abstract_overlap"] < 0.1
    half = expand.reward_breakdown(ABSTRACT, {"background": BACKGROUND, "method": UNRELATED_METHOD})
    assert other["abstract_overlap"] < half["abstract_overlap"] < same["abstract_overlap"]


def test_rewards_equal_per_joint_reward_and_analyse_each_text_once(expand, monkeypatch):
    bgs = [BACKGROUND, UNRELATED_BG, ""]
    methods = [METHOD, UNRELATED_METHOD, words(60)]
    joint = [{"background": a, "method": b} for a, b in itertools.product(bgs, methods)]  # the cross mode
    expected = [expand.reward(ABSTRACT, o) for o in joint]
    calls = []
    real = W.TextStats.of.__func__
    monkeypatch.setattr(W.TextStats, "of", classmethod(lambda cls, t: calls.append(t) or real(cls, t)))
    assert expand.rewards(ABSTRACT, joint) == expected
    assert sorted(calls) == sorted(bgs + methods)  # 6 distinct texts for 9 joint actions
    assert len(set(expected)) > 3


def test_feedback_names_the_weakest_level(tldr):
    msg = tldr.feedback(P, {"tldr": words(10), "summary": words(40, "s")}, 0.0)
    assert msg == "The summary is too short: 40 words, needs 60-250."
    assert tldr.feedback(P, {"tldr": "", "summary": words(100)}, 0.0) == "The TL;DR is empty: 0 words, needs 5-40."
    out = {"tldr": IDEAL_TLDR, "summary": IDEAL_SUMMARY + " " + words(170)}  # ratio 15.2: the weakest level
    assert "as long as the TL;DR; aim for 2-10x" in tldr.feedback(P, out, tldr.reward(P, out))
    out = {"tldr": IDEAL_TLDR, "summary": IDEAL_SUMMARY.replace("Moreover", "Then").replace("As a result", "So")}
    assert "transition words" in tldr.feedback(P, out, tldr.reward(P, out))


# ------------------------------------------------------------------ prompts and the single baseline


def test_prompts_hold_the_source_and_differ_per_role(tldr, expand):
    p = tldr.problems()[0]
    a, b = (tldr.prompt(p, r)[0]["content"] for r in tldr.roles)
    assert a != b and "TL;DR" in a and "detailed summary" in b
    for text in (a, b):
        assert p.data["title"] in text
        assert " ".join(p.data["introduction"].split()[:12]) in text
        assert " ".join(p.data["conclusion"].split()[:12]) in text
    short = WritingTLDR(WritingTLDROptions(max_source_words=40, num_problems=1))
    d = short.problems()[0].data
    assert len(d["introduction"].split()) + len(d["conclusion"].split()) <= 40 + 2  # + the "..." marks
    with pytest.raises(ValueError, match=r"role 'critic'.*'tldr', 'summary'"):
        tldr.prompt(p, "critic")

    q = expand.problems()[0]
    bg, me = (expand.prompt(q, r)[0]["content"] for r in expand.roles)
    assert bg != me and "background" in bg and "method" in me
    for aspect in ("challenge", "approach", "outcome"):
        assert q.data["summaries"][aspect] in bg and q.data["summaries"][aspect] in me
    assert q.data["abstract"] not in bg  # the target stays hidden

    later = tldr.prompt(p, "summary", turn=1, history=[{"tldr": "MY-TLDR", "summary": "MY-SUMMARY"}],
                        feedback="The summary is too short.")[0]["content"]
    assert "MY-TLDR" in later and "MY-SUMMARY" in later and "The summary is too short." in later


def test_single_prompt_and_split(tldr, expand):
    text = tldr.single_prompt(tldr.problems()[0])[0]["content"]
    assert "TL;DR:" in text and "SUMMARY:" in text
    assert tldr.split_single("TL;DR: Short.\nSUMMARY: Long text\nover lines.") == {
        "tldr": "Short.", "summary": "Long text\nover lines."}
    assert tldr.split_single("**Summary:** body\n**TLDR:** one line") == {"tldr": "one line", "summary": "body"}
    assert tldr.split_single("TL;DR: only this") == {"tldr": "only this", "summary": ""}
    assert tldr.split_single("no markers at all") == {"tldr": "", "summary": ""}
    assert expand.split_single("Background: b part Method: m part") == {"background": "b part", "method": "m part"}
    assert "BACKGROUND:" in expand.single_prompt(expand.problems()[0])[0]["content"]

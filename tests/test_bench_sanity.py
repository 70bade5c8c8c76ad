"""The benchmark's sanity checks and table: a side with empty completions or a prompt-covering loss is flagged."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _anchors():
    spec = importlib.util.spec_from_file_location("anchors", REPO / "bench" / "anchors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sanity(**kw):
    s = {"completions": 16, "non_empty": 16, "mean_tokens": 32.0, "rewards": [0.1, 0.5, 0.3], "completion_only_loss": True}
    s.update(kw)
    return s


def test_sane_output_passes_and_the_comlrl_prompt_length_defect_fails():
    a = _anchors()
    assert a.sanity_verdict(_sanity(), 32).startswith("ok: 16/16 non-empty, 32.0 tokens each")
    # what CoMLRL 1.4.3 did with SmolLM2's pad token (<|im_end|>) in every chat prompt: rewards on empty strings
    broken = _sanity(non_empty=0, mean_tokens=0.0, rewards=[0.0] * 8, completion_only_loss=False, prompts_with_pad=4)
    verdict = a.sanity_verdict(broken, 32)
    assert verdict.startswith("FAILED")
    for part in ("16/16 completions empty", "not 32", "4 prompts hold the pad token", "(all equal)"):
        assert part in verdict, verdict


def test_merge_sanity_adds_counts_and_needs_every_process_sane():
    a = _anchors()
    merged = a.merge_sanity([_sanity(loss_tokens=512, generated_tokens=512), _sanity(completion_only_loss=False,
                                                                                     loss_tokens=512, generated_tokens=512)])
    assert merged["completions"] == 32 and merged["loss_tokens"] == 1024 and not merged["completion_only_loss"]


def test_table_shows_medians_spread_worst_ratio_and_sanity():
    a = _anchors()
    run = {"kind": "magrpo", "anchor": "comlrl", "T": 32, "tokens": 512, "teamrl_s": 20.0, "anchor_s": 100.0,
           "teamrl_all": [19.0, 20.0, 25.0], "anchor_all": [90.0, 100.0, 110.0], "teamrl_phases": [],
           "teamrl_sanity": _sanity(), "anchor_sanity": _sanity(non_empty=0),
           "teamrl_versions": {"torch": "x"}, "anchor_versions": {"comlrl": "1.4.3"}}
    args = argparse.Namespace(threads=2, steps=1, rounds=3)
    text = a.render({"anchors": [run]}, args)
    row = next(line for line in text.splitlines() if line.startswith("| (a)"))
    assert "20.0 s (19.0-25.0 s, n=3)" in row and "5.00x (3.60-5.79x)" in row
    assert "met (>= 5); worst NOT met (target 5)" in row
    assert row.endswith("| ok / FAILED |")


def test_equal_rewards_fail_the_side():
    # with every reward equal, teamrl's update skips its passes (zero advantages) while an anchor runs its own:
    # the ratio would not compare the same work, so such a side does not pass
    a = _anchors()
    verdict = a.sanity_verdict(_sanity(rewards=[0.0] * 16), 32)
    assert verdict.startswith("FAILED") and "rewards all equal" in verdict, verdict

"""M-GRPO: the research environment, trajectory alignment, rewards flowing down, baselines, decoupled training."""

import json
import os
import random
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from teamrl.algorithms import make_algorithm
from teamrl.algorithms.m_grpo import MGRPO, MGRPOConfig, align_subtrajectories, group_key, prepare_sub_samples
from teamrl.cli import main as cli_main
from teamrl.core.config import ConfigError, load_config
from teamrl.core.sample import Sample
from teamrl.tasks import TASKS, make_task
from teamrl.tasks.task import Problem
from teamrl.tasks.research import (Action, ResearchEnv, ResearchOptions, answers_match, open_page, parse_action, search,
                                   sub_reward, well_formed)
from teamrl.rollout.scheduler import GenerationScheduler
from teamrl.trainer.trainer import Trainer, make_trainer
from teamrl.workflows import Workflow
from teamrl.workflows.context import EpisodeContext
from tests.scripted import scripted_rollout

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


# --- the environment ---------------------------------------------------------------------------


def _chain_answer(env: ResearchEnv, question: str) -> str:
    """Answer a generated question by using only the tools, as an agent would."""
    company = question.split("founder of ")[1].split(" born?")[0].split(" in the year")[0]
    first = search(env.pages, company).splitlines()[0].split(":")[0]
    company_page = open_page(env.pages, first)
    person_id = company_page.split("(page ")[1].split(")")[0]
    person_page = open_page(env.pages, person_id)
    city_id = person_page.split("(page ")[1].split(")")[0]
    city_page = open_page(env.pages, city_id)
    if "which city" in question:
        return city_page.splitlines()[0]
    if "which country" in question:
        return city_page.split(" is a city in ")[1].split(" with ")[0]
    founded = int(company_page.split("founded in ")[1].split(" ")[0])
    born = int(person_page.split("was born in ")[1].split(" ")[0])
    return str(founded - born)


def test_generated_questions_are_answerable_through_the_tools_and_seeded():
    env = ResearchEnv(ResearchOptions(num_problems=9, seed=3))
    again = ResearchEnv(ResearchOptions(num_problems=9, seed=3))
    other = ResearchEnv(ResearchOptions(num_problems=9, seed=4))
    assert [p.data for p in env.problems()] == [p.data for p in again.problems()]
    assert [p.data for p in env.problems()] != [p.data for p in other.problems()]
    assert {p.data["kind"] for p in env.problems()} == {"city", "country", "age"}
    for p in env.problems():
        found = _chain_answer(env, p.data["question"])
        assert env.correct(p, found), (p.data, found)
        assert env.main_reward(p, found, True) == 1.0
        assert env.main_reward(p, "nowhere", True) == pytest.approx(0.1)
        assert env.main_reward(p, None, False) == 0.0


def test_tools_and_parsers():
    env = ResearchEnv(ResearchOptions(num_problems=2))
    pid = next(iter(env.pages))
    assert env.pages[pid].title in open_page(env.pages, pid)
    assert "no page 'zzz'" in open_page(env.pages, "zzz")
    assert search(env.pages, "!!!") == "(empty query)"
    assert parse_action("think <search>a b</search> then <result> x </result>", ("search", "result")) == Action("result", "x")
    assert parse_action("no tags here", ("answer",)).kind == "invalid"
    assert parse_action("<answer>x</answer>", ("subtask",)).kind == "invalid"
    assert well_formed("<open>p001</open>", ("open",)) and not well_formed("<open>a</open><search>b</search>", ("open", "search"))
    assert answers_match(" Mirath.", "mirath") and answers_match("035", "35") and not answers_match("", "")
    with pytest.raises(ValueError, match="not a tool"):
        env.run_tool(Action("answer", "x"))


def test_python_tool_runs_in_the_sandbox_not_in_this_process():
    env = ResearchEnv(ResearchOptions(num_problems=1))
    assert env.run_tool(Action("python", "print(2023 - 1961)")).strip() == "62"
    out = env.run_tool(Action("python", "import os\nprint(os.getpid())"))
    assert out.strip().isdigit() and int(out) != os.getpid()
    assert "failed" in env.run_tool(Action("python", "raise ValueError('boom')"))


def test_user_corpus_and_questions_load_from_jsonl(tmp_path):
    corpus, qa = tmp_path / "pages.jsonl", tmp_path / "qa.jsonl"
    corpus.write_text(json.dumps({"id": "a", "title": "Alpha", "text": "Alpha links to Beta (page b)."}) + "\n"
                      + json.dumps({"id": "b", "title": "Beta", "text": "Beta has 7 moons."}) + "\n")
    qa.write_text(json.dumps({"question": "How many moons has the page Alpha links to?", "answer": 7}) + "\n")
    env = make_task({"name": "research", "source": "files", "corpus_path": str(corpus), "qa_path": str(qa)})
    (p,) = env.problems()
    assert env.correct(p, "7") and not env.correct(p, "8")
    assert search(env.pages, "beta").splitlines()[0] == "b: Beta"
    with pytest.raises(ConfigError, match="task.qa_path.*is not a file"):
        make_task({"name": "research", "source": "files", "corpus_path": str(corpus), "qa_path": str(tmp_path / "no.jsonl")})
    corpus.write_text(json.dumps({"id": "a", "text": "no title"}) + "\n")
    with pytest.raises(ConfigError, match=r"row 1 lacks string field\(s\) \['title'\]"):
        make_task({"name": "research", "source": "files", "corpus_path": str(corpus), "qa_path": str(qa)})


# --- alignment and rewards ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 4), st.integers(0, 2**31))
def test_alignment_gives_d_max_slots_per_rollout_whatever_the_call_counts(counts, d_max, seed):
    slots = align_subtrajectories(counts, d_max, random.Random(seed))
    assert len(slots) == len(counts)
    if not any(counts):
        assert all(row == [] for row in slots)
        return
    assert all(len(row) == d_max for row in slots)  # the fixed batch: K * d_max per question
    kept = set()
    for i, (n, row) in enumerate(zip(counts, slots)):
        if n == 0:
            continue
        assert all(r == i and 0 <= c < n for r, c in row)  # a rollout with calls uses its own
        own = {c for _, c in row}
        assert len(own) == min(n, d_max)  # every call kept when <= d_max; d_max distinct ones when more
        kept |= {(i, c) for c in own}
    for n, row in zip(counts, slots):
        if n == 0:
            assert set(row) <= kept  # borrowed from the question's kept sub-trajectories
    assert slots == align_subtrajectories(counts, d_max, random.Random(seed))  # seeded


def test_alignment_rejects_bad_input():
    with pytest.raises(ValueError, match="d_max=0"):
        align_subtrajectories([1], 0, random.Random(0))
    with pytest.raises(ValueError, match="counts"):
        align_subtrajectories([-1], 2, random.Random(0))


def _sub(pid, ep, call, turn, valid):
    return Sample("sub", "sub", pid, [1, 2], [3], [0.0], episode=ep, turn=turn,
                  tags={"parent_episode": ep, "call": call, "format_valid": valid})


@pytest.mark.parametrize("mode", ["gated", "outcome", "format"])
def test_sub_rewards_follow_the_parent_outcome_as_configured(mode):
    # question q: rollout 0 made 3 calls (one more than d_max), rollout 1 one call (2 turns), rollout 2 none
    sub = [_sub("q", 0, c, 0, valid=c != 1) for c in range(3)] + [_sub("q", 1, 0, 0, True), _sub("q", 1, 0, 1, True)]
    outcomes = {("q", 0): 1.0, ("q", 1): 0.1, ("q", 2): 0.0}
    out = prepare_sub_samples(sub, outcomes, d_max=2, mode=mode, seed=5)
    trained = [s for s in out if s.trainable]
    dropped = [s for s in out if s.tags.get("dropped")]
    assert sum(s.turn == 0 for s in trained) == 3 * 2  # K * d_max sub-trajectories
    assert len(dropped) == 1 and dropped[0].tags["parent_episode"] == 0
    for s in trained + dropped:
        parent = outcomes[("q", s.tags["parent_episode"])]
        assert s.reward == sub_reward(parent, s.tags["format_valid"], mode)
        assert s.group == ("q", "sub") == group_key(s)
    expected = {"gated": {(0, 1): 0.0, (0, 0): 1.0, (1, 0): 0.1}, "outcome": {(0, 1): 1.0, (0, 0): 1.0, (1, 0): 0.1},
                "format": {(0, 1): 0.0, (0, 0): 1.0, (1, 0): 1.0}}[mode]
    for s in out:
        key = (s.tags["parent_episode"], s.tags["call"])
        if key in expected:
            assert s.reward == expected[key]
    dups = [s for s in trained if s.tags.get("duplicate")]
    assert dups and all(d is not o for d in dups for o in sub)  # duplicates are copies, full samples in the loss
    frozen = prepare_sub_samples([_sub("q", 0, 0, 0, True)], {("q", 0): 1.0}, d_max=2, mode=mode, seed=5, frozen=True)
    assert len(frozen) == 2 and all(not s.trainable for s in frozen)
    with pytest.raises(ValueError, match=r"rollout\(s\) \[\('q', 7\)\] have no main outcome"):
        prepare_sub_samples([_sub("q", 7, 0, 0, True)], {("q", 0): 1.0}, d_max=2, mode=mode, seed=5)


def test_sub_calls_per_rollout_counts_a_user_workflows_sub_episodes(monkeypatch):
    """A user workflow opens workers with ``ctx.sub_episode`` and reports no ``stats["calls"]``: the
    metric counted only reported calls, so it logged 0.0 while the workers ran 1.5 times per rollout."""
    from teamrl.algorithms.m_grpo import MGRPO, MGRPOConfig
    from teamrl.tasks.solve import MathSolve, MathSolveOptions
    from teamrl.workflows import WORKFLOWS, EpisodeOutcome, register_workflow
    from tests.fakes import run_all, scripted_factory

    monkeypatch.setattr(WORKFLOWS, "_items", dict(WORKFLOWS._items))  # leave the library's registry alone

    @register_workflow("orch_counted", roles=("orchestrator", "worker"), sub_roles=("worker",))
    async def orch(ctx, task, problem, settings):
        await ctx.generate("orchestrator", task.prompt(problem))
        for _ in range(1 + ctx.episode % 2):  # episodes 0, 2: one worker; 1, 3: two
            await ctx.sub_episode("worker").generate("worker", "do a part")
        return EpisodeOutcome("", None, False)

    task = MathSolve(MathSolveOptions(num_problems=4, test_size=2))
    algo = MGRPO(MGRPOConfig(), workflow="orch_counted", k=4)
    samples = algo.rollout(task.problems(), task, scripted_factory(), run_all)
    assert sum(s.role == "worker" and not s.tags.get("duplicate") for s in samples) == 2 * 6
    assert algo.metrics(samples)["sub_calls_per_rollout"] == 1.5


# --- end to end on a tiny model ----------------------------------------------------------------


def _h(text: str) -> int:
    return sum(map(ord, text))


class ScriptedResearch(ResearchEnv):
    """Actions read from a hash of the (random) text, so a tiny random model makes 0..3 calls and varied rewards."""

    name = "research_scripted"

    def parse_main(self, text):
        h = _h(text) % 8
        return Action("subtask", "find the founder") if h < 5 else Action("answer", "yes" if h == 7 else "no")

    def parse_sub(self, text):
        return Action("result", "found") if _h(text) % 3 == 0 else Action("search", "founded")

    def sub_well_formed(self, text):
        return _h(text) % 5 != 0

    def parse_single(self, text):
        h = _h(text) % 4
        return Action("answer", "yes" if h == 0 else "no") if h < 2 else Action("search", "founded")

    def correct(self, problem, answer):
        return answer == "yes"


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setitem(TASKS, ScriptedResearch.name, ScriptedResearch)


def _cfg(tmp_path, *extra):
    return load_config(None, ["algorithm=m_grpo", "task={name: research_scripted, num_problems: 6, max_sub_calls: 3, max_sub_turns: 2}",
                              "model=tiny-random", "rollout.group_size=4", "rollout.batch_size=2", "rollout.max_new_tokens=8",
                              "policy.lora.r=4", "train.steps=2", "train.lr=0.01", "threads=1", "m_grpo.d_max=2", f"run.dir={tmp_path}",
                              "run.progress=false", "run.tensorboard=false", "run.log_episodes=false", "name=t", *extra])


def test_team_rollout_rewards_reach_sub_samples_through_parent_ids(tmp_path, scripted):
    tr = Trainer(_cfg(tmp_path, "policy.mode=lora_per_role"))
    before = {n: {k: v.clone() for k, v in p.named_state().items()} for n, p in tr.router.policies.items()}
    tr.train_step()
    rec = tr.train_step()
    scheduler = GenerationScheduler(tr.engine, seed=11)
    samples = tr.algorithm.rollout(tr.problems[:2], tr.task, lambda p, e, t: EpisodeContext(
        scheduler, tr.route, tr.tokenizer, tr.params, p.id, e, t), scheduler.run)
    main = {(s.problem_id, s.episode): s.reward for s in samples if s.role == "main"}
    sub = [s for s in samples if s.role == "sub"]
    assert sub and {s.tags["call"] for s in sub} >= {0, 1}
    for s in sub:
        assert s.tags["parent_episode"] == s.episode
        assert s.reward == sub_reward(main[(s.problem_id, s.episode)], s.tags["format_valid"], "gated")
    for pid in {s.problem_id for s in sub}:  # 4 rollouts x d_max=2 sub-trajectories per question
        assert sum(1 for s in sub if s.problem_id == pid and s.turn == 0 and s.trainable) == 8
    assert rec["sub_calls_per_rollout"] > 0 and "sub_format_valid" in rec and "reward/sub" in rec
    for name in ("main", "sub"):  # both agents learned (their own adapters)
        after = tr.router.policies[name].named_state()
        assert any(not torch.equal(before[name][k], after[k]) for k in after), name


def test_frozen_sub_agent_gets_no_update_and_single_agent_has_no_sub(tmp_path, scripted):
    tr = Trainer(_cfg(tmp_path, "policy.mode=lora_per_role", "m_grpo.sub_agent=frozen"))
    before = {n: {k: v.clone() for k, v in p.named_state().items()} for n, p in tr.router.policies.items()}
    rec = tr.train_step()
    assert rec["sub_calls_per_rollout"] > 0 and "loss/sub" not in rec
    sub_after, main_after = tr.router.policies["sub"].named_state(), tr.router.policies["main"].named_state()
    assert all(torch.equal(before["sub"][k], sub_after[k]) for k in sub_after)
    assert any(not torch.equal(before["main"][k], main_after[k]) for k in main_after)

    single = Trainer(_cfg(tmp_path, "name=single", "m_grpo.agents=single", "run.log_episodes=true"))
    assert single.roles == ["main"]
    rec = single.train_step()
    assert rec["sub_calls_per_rollout"] == 0 and "loss/shared" in rec
    logged = [json.loads(line) for line in (tmp_path / "single" / "episodes" / "step_000001.jsonl").read_text().splitlines()]
    assert {r["role"] for r in logged} == {"main"}
    later = [r for r in logged if r["turn"] > 0]  # the single agent used the tools itself
    assert later and all("Tool output:" in r["prompt"] and "p0" in r["prompt"] for r in later)


def test_m_grpo_needs_the_research_env_and_configs_load(tmp_path):
    with pytest.raises(ConfigError, match="m_grpo runs on the research environment"):
        make_algorithm(load_config(None, ["algorithm=m_grpo"]), make_task({"name": "word_count"}))
    with pytest.raises(ConfigError, match="research"):
        make_algorithm(load_config(None, ["algorithm=grpo"]), make_task({"name": "research"}))
    with pytest.raises(ConfigError, match="^m_grpo.decoupled was moved: write policy.mode=separate"):
        load_config(None, ["m_grpo.decoupled=rays"])
    import importlib.util

    real = importlib.util.find_spec
    with pytest.MonkeyPatch.context() as mp:  # without the ray package, the ray mode fails at config time
        mp.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
        with pytest.raises(ConfigError, match=r"policy.placement: ray needs the ray package"):
            load_config(None, ["algorithm=m_grpo", "task.name=research", "policy.mode=separate", "policy.placement=ray"])
    names = [f for f in os.listdir(CONFIGS) if f.startswith("m_grpo_")]
    assert len(names) >= 3
    for f in names:
        cfg = load_config(os.path.join(CONFIGS, f))
        assert cfg.algorithm == "m_grpo" and cfg.task["name"] == "research"
        make_algorithm(cfg, make_task(cfg.task))


def test_teamrl_train_runs_the_m_grpo_config(tmp_path, capsys):
    rc = cli_main(["train", os.path.join(CONFIGS, "m_grpo_research.yaml"), "model=tiny-random", "train.steps=1",
                   "rollout.max_new_tokens=8", "rollout.batch_size=1", "rollout.group_size=2", f"run.dir={tmp_path}",
                   "run.progress=false", "run.tensorboard=false"])
    assert rc == 0
    assert "seconds per step" in capsys.readouterr().out
    assert (tmp_path / "m_grpo_research" / "metrics.jsonl").is_file()


# --- decoupled training ------------------------------------------------------------------------


def _decoupled_run(tmp_path, mode):
    tr = make_trainer(_cfg(tmp_path, f"name={mode}", "policy.mode=separate",
                           f"policy.placement={'ray' if mode == 'ray' else 'local'}"))
    records = [tr.train_step(), tr.train_step()]
    weights = {a: tr.learner.state(a)[0] for a in tr.router.policies}
    return tr, records, weights


def test_decoupled_ray_equals_in_process_and_a_killed_worker_fails_clearly(tmp_path, scripted):
    ray = pytest.importorskip("ray")
    from teamrl.trainer.learner import WorkerFailed

    inproc, rec_a, w_a = _decoupled_run(tmp_path, "inprocess")
    assert set(inproc.router.policies) == {"main", "sub"} and inproc.cfg.policy.mode == "separate"
    # both agents really learned, so the comparison below is not vacuous
    assert all(r["sub_calls_per_rollout"] > 0 for r in rec_a)
    assert any(r["grad_norm/main"] > 0 for r in rec_a) and any(r["grad_norm/sub"] > 0 for r in rec_a)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never another run's Ray
    try:
        tr, rec_b, w_b = _decoupled_run(tmp_path, "ray")
        for a, b in zip(rec_a, rec_b):
            for key in ("loss/main", "loss/sub", "grad_norm/main", "grad_norm/sub", "reward_mean", "sub_calls_per_rollout"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        for agent in ("main", "sub"):
            assert w_a[agent].keys() == w_b[agent].keys()
            for k in w_a[agent]:
                assert torch.allclose(w_a[agent][k], w_b[agent][k], atol=1e-6, rtol=1e-5), (agent, k)

        assert set(tr.learner.actors) == {"main", "sub"}  # one worker (Ray actor) per agent
        tr.learner.timeout = 30.0
        ray.kill(tr.learner.actors["main"])
        t0 = time.perf_counter()
        with pytest.raises(WorkerFailed, match="policy worker 'main' died"):
            tr.train_step()
        assert time.perf_counter() - t0 < 30
        tr.shutdown()
    finally:
        ray.shutdown()


def test_decoupled_checkpoint_resumes_every_worker_and_eval_runs(tmp_path, scripted, capsys):
    cfg = _cfg(tmp_path, "name=ckpt", "policy.mode=separate", "policy.placement=local", "run.save_every=1", "train.steps=1")
    tr = make_trainer(cfg)
    tr.train_step()
    saved = {a: tr.learner.state(a)[0] for a in tr.router.policies}
    fresh = make_trainer(_cfg(tmp_path, "name=fresh", "policy.mode=separate", "policy.placement=local"))
    again = make_trainer(cfg, resume=True)
    assert again.step == 1
    moved = False
    for a in saved:
        resumed, initial = again.learner.state(a)[0], fresh.learner.state(a)[0]
        assert all(torch.equal(saved[a][k], resumed[k]) for k in saved[a])
        moved |= any(not torch.equal(saved[a][k], initial[k]) for k in saved[a])
    assert moved  # the checkpoint holds trained weights, not the initial ones
    # the decoupled checkpoint (one adapter per agent) loads into teamrl eval's lora_per_role router
    rc = cli_main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--limit", "2", "policy.mode=lora_per_role"])
    out = capsys.readouterr().out
    assert rc == 0 and all(f"| {m} |" in out for m in ("team", "untrained", "single"))


# --- d_max: a rollout whose sub-agent calls are dropped or duplicated says so ---------------------

SUB_CALLS: list[int] = []  # sub-agent calls of each episode, set by the test


async def lead_with_workers(ctx, task, problem, settings):
    """The lead opens SUB_CALLS[episode] worker sub-episodes, then answers."""
    for i in range(SUB_CALLS[ctx.episode]):
        await ctx.sub_episode("worker").generate("worker", f"{problem.id} part {i}")
    await ctx.generate("lead", f"{problem.id} answer")
    return float(ctx.episode % 2)


LEAD_WITH_WORKERS = Workflow(lead_with_workers, ("lead", "worker"), sub_roles=("worker",))


def _workers_rollout(calls: list[int], d_max: int = 2):
    SUB_CALLS[:] = calls
    algo = MGRPO(MGRPOConfig(d_max=d_max), workflow="tests.test_mgrpo:LEAD_WITH_WORKERS", k=len(calls))
    return algo, scripted_rollout(algo, [Problem("q")], None, lambda policy, prompt, n: ["ok"] * n)


def test_d_max_dropping_or_duplicating_sub_calls_is_reported_once(capsys):
    # before: with 0..3 calls per rollout and d_max 2, a worker call was dropped untrained and others duplicated, silently
    algo, samples = _workers_rollout([0, 1, 2, 3])
    assert any(s.tags.get("dropped") for s in samples) and any(s.tags.get("duplicate") for s in samples)
    err = capsys.readouterr().err
    print(err)
    warnings = [line for line in err.splitlines() if line.startswith("warning: m_grpo:")]
    assert len(warnings) == 1 and "m_grpo.d_max=2" in warnings[0] and "0 to 3" in warnings[0]
    scripted_rollout(algo, [Problem("q")], None, lambda policy, prompt, n: ["ok"] * n)
    assert "warning:" not in capsys.readouterr().err  # once per run


def test_d_max_matching_every_rollout_is_not_reported(capsys):
    _, samples = _workers_rollout([2, 2, 2, 2])
    assert not any(s.tags.get("dropped") or s.tags.get("duplicate") for s in samples)
    assert "warning:" not in capsys.readouterr().err

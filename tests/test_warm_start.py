"""Warm start (``teamrl sft``): cross-entropy on completion tokens only, the loss on demonstrations
falls, the task's own demonstrations are right, and the warm-started checkpoint resumes into RL."""

import io
import json
from contextlib import redirect_stdout
from dataclasses import replace

import pytest
import torch

from teamrl.core.config import InputError, load_config
from teamrl.trainer.sft import Demonstration, load_demonstrations, sft_loss, task_demonstrations, warm_start


def _cfg(tmp_path, *extra):
    return load_config(None, ["name=ws", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "task.name=math.solve",
                              "task.source=generated_easy", "task.num_problems=12", "task.test_size=3",
                              "workflow.name=single", "rollout.group_size=2", "rollout.batch_size=1",
                              "rollout.max_new_tokens=4", "train.steps=1", "run.progress=false", "run.tensorboard=false",
                              "policy.lora.r=4", "train.lr=1e-2", *extra])


def test_sft_loss_is_the_cross_entropy_of_completion_tokens_only(tiny):
    model, tok = tiny
    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    loss, tokens = sft_loss(model, prompts, completions, tok.pad_token_id)
    assert tokens == 5
    nll = []
    for p, c in zip(prompts, completions):  # one unpadded sequence at a time, by hand
        logits = model(input_ids=torch.tensor([p + c])).logits[0]
        nll += torch.nn.functional.cross_entropy(logits[len(p) - 1:-1], torch.tensor(c), reduction="none").tolist()
    assert float(loss) == pytest.approx(sum(nll) / len(nll), rel=1e-4)


def test_sft_loss_falls_and_the_warm_start_resumes_into_rl(tmp_path):
    from teamrl.tasks import make_task
    from teamrl.trainer.trainer import Trainer

    cfg = _cfg(tmp_path)
    task = make_task(cfg.task)
    demos = task_demonstrations(task, task.problems()[:2])
    run_dir, records = warm_start(cfg, demos, epochs=8, batch_size=6, progress=False)
    losses = [r["loss"] for r in records]  # measured: 5.67 -> 4.96 (tiny random model, LoRA r=4)
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.4 and sum(losses[-3:]) < sum(losses[:3]) - 0.9, losses
    assert (run_dir / "checkpoints" / "step_000000").is_dir() and (run_dir / "sft.jsonl").is_file()
    saved = torch.load(run_dir / "checkpoints" / "step_000000" / "policy_shared.pt")

    with pytest.raises(Exception, match="--resume"):
        Trainer(cfg)  # the warm start is a checkpoint of this run: RL continues it, never overwrites it
    trainer = Trainer(cfg, resume=True)
    assert trainer.step == 0  # RL starts at step 0 ...
    weights = trainer.router.policies["shared"].named_state()
    assert all(torch.equal(weights[k], v) for k, v in saved.items())  # ... from the warm-started weights
    assert trainer.router.policies["shared"].optimizer.param_groups[0]["lr"] == cfg.train.lr
    assert not trainer.router.policies["shared"].optimizer.state  # fresh moments, not SFT's
    trainer.train()
    assert (run_dir / "checkpoints" / "step_000001").is_dir()


def test_demonstrations_from_a_jsonl_file_and_its_errors(tmp_path):
    good = tmp_path / "demos.jsonl"
    good.write_text(json.dumps({"role": "agent", "messages": [{"role": "user", "content": "2+2?"}], "completion": "Answer: 4"})
                    + "\n\n" + json.dumps({"role": "agent", "messages": "3+3?", "completion": "Answer: 6"}) + "\n")
    assert load_demonstrations(good) == [Demonstration("agent", [{"role": "user", "content": "2+2?"}], "Answer: 4"),
                                         Demonstration("agent", "3+3?", "Answer: 6")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"role": "agent", "messages": "q"}) + "\n")
    with pytest.raises(InputError, match=r"bad.jsonl:1: missing \['completion'\]"):
        load_demonstrations(bad)
    bad.write_text('{"role": "agent", "messages": [{"text": 1}], "completion": "x"}\n')
    with pytest.raises(InputError, match="bad.jsonl:1: messages .* must be a string or a list of"):
        load_demonstrations(bad)
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_demonstrations(tmp_path / "absent.jsonl")


def test_cli_sft_from_a_file_then_an_unknown_role_is_one_line(tmp_path, capsys):
    from teamrl.cli import main

    demos = tmp_path / "demos.jsonl"
    demos.write_text(json.dumps({"role": "agent", "messages": "What is 2+2?", "completion": "Answer: 4"}) + "\n")
    first, *rest = _cfg_args(tmp_path)  # overrides on both sides of the options, as a user types them
    base = ["sft", first, "--data", str(demos), "--epochs", "2", *rest]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "policy shared: demonstration loss" in out and "--resume" in out
    demos.write_text(json.dumps({"role": "critic", "messages": "q", "completion": "a"}) + "\n")
    assert main([*base, "name=other"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'critic' is not a role of this run" in err and "['agent']" in err


def _cfg_args(tmp_path):
    return ["name=cli", f"run.dir={tmp_path}", "model=tiny-random", "threads=1", "task.name=math.solve",
            "task.source=generated_easy", "task.num_problems=12", "task.test_size=3", "workflow.name=single",
            "run.progress=false", "policy.lora.r=4"]


def test_task_without_demonstrations_says_what_to_do():
    from teamrl.tasks import make_task

    with pytest.raises(InputError, match="no demonstrations\\(problem\\) method.*--data"):
        task_demonstrations(make_task({"name": "word_count"}), [])


def test_math_and_plan_path_demonstrations_are_correct_answers():
    from teamrl.tasks import make_task
    from teamrl.tasks.plan_path import BFS_PROGRAM, shortest_path

    math = make_task({"name": "math.solve", "source": "generated", "num_problems": 6, "test_size": 2})
    for p in math.problems():
        ((role, messages, completion),) = math.demonstrations(p)
        assert role == "agent" and messages == math.prompt(p) and math.reward(p, completion) == 1.0
        assert math.valid(p, completion)
    env = make_task({"name": "plan_path", "num_problems": 4})
    for p in env.problems():
        (tool, tool_msgs, program), (planner, planner_msgs, answer) = env.demonstrations(p)
        assert (tool, planner) == ("tool", "planner") and tool_msgs == env.observe(env.reset(p), "tool")
        state = env.reset(p)
        printed = io.StringIO()
        with redirect_stdout(printed):  # our own BFS program (trusted), run on the prelude the sandbox would give it
            exec(env.tool_setup(state) + program.strip("`").removeprefix("python\n"), {})
        assert printed.getvalue().split() == list(shortest_path(state.grid, state.pos, state.goal))
        assert printed.getvalue().strip() in planner_msgs[0]["content"]  # the planner sees the tool's output
        end, _ = env.apply(state, "planner", answer)
        assert env.success(end) and env.team_reward(end) == 1.0  # a shortest path: full team reward
    assert BFS_PROGRAM.count("print(") == 1


@pytest.mark.parametrize("spec", [{"name": "sokoban", "num_problems": 3}, {"name": "sudoku", "size": 4, "num_problems": 3},
                                  {"name": "sudoku", "size": 9, "num_problems": 2}], ids=["sokoban", "sudoku4", "sudoku9"])
def test_sokoban_and_sudoku_demonstrations_solve_the_first_turn(spec):
    """The tool's program, run as the environment runs it (the sandbox), prints what the planner's
    prompt shows and scores TOOL_SOLVED; the planner's answer, executed, solves the puzzle."""
    from teamrl.tasks import make_task
    from teamrl.tasks.tool_planner import TOOL_SOLVED

    env = make_task(spec)
    for i, p in enumerate(env.problems()):
        state = env.reset(p)
        (tool, tool_msgs, program), (planner, planner_msgs, answer) = env.demonstrations(p)
        assert (tool, planner) == ("tool", "planner") and tool_msgs == env.observe(state, "tool")
        assert program == f"```python\n{env.reference_program}```"
        printed = io.StringIO()
        with redirect_stdout(printed):  # our own program (trusted), run on the prelude the sandbox would give it
            exec(env.tool_setup(state) + env.reference_program, {})
        assert planner_msgs == env.observe(replace(state, tool_output=printed.getvalue().strip()), "planner")
        if i == 0:  # and once per task in the sandbox, as the environment runs it
            after_tool, reward = env.apply(state, "tool", program)
            assert reward == TOOL_SOLVED and planner_msgs == env.observe(after_tool, "planner")
        end, _ = env.apply(state, "planner", answer)
        assert end.solved and env.team_reward(end) == 1.0, (p.id, answer)


def test_task_demonstrations_accepts_sokoban_and_sudoku():
    from teamrl.tasks import make_task

    for spec in ({"name": "sokoban", "num_problems": 2}, {"name": "sudoku", "num_problems": 2}):
        task = make_task(spec)
        demos = task_demonstrations(task, task.problems())
        assert [d.role for d in demos] == ["tool", "planner"] * 2 and all(d.completion for d in demos)


def test_research_demonstrations_are_a_correct_episode_of_the_real_workflow():
    """Replayed through research_team, the demonstrations are exactly the prompts the agents see,
    every reply is well-formed, and the episode ends with the correct answer."""
    from teamrl.policies.chat import encode_chat
    from teamrl.rollout.engine import SamplingParams
    from teamrl.rollout.scheduler import GenerationScheduler
    from teamrl.tasks import make_task
    from teamrl.workflows.context import EpisodeContext
    from teamrl.workflows.research_team import research_team
    from tests.scripted import TOK, ScriptedEngine

    env = make_task({"name": "research", "num_problems": 6})
    for p in env.problems()[:3]:  # one question of each kind: city, country, age
        demos = env.demonstrations(p)
        replies = {(role, TOK.decode(encode_chat(TOK, msgs), skip_special_tokens=True)): text for role, msgs, text in demos}
        used = []

        def script(policy, prompt, n):
            used.append((policy, prompt))
            return [replies[(policy, prompt)]]

        sched = GenerationScheduler(ScriptedEngine(script))
        ctx = EpisodeContext(sched, lambda role: role, TOK, SamplingParams(max_new_tokens=8), p.id, 0)
        (outcome,) = sched.run([research_team(ctx, env, p)])
        assert outcome.correct and outcome.valid and all(c.format_valid for c in outcome.calls), (p.data, outcome)
        assert sorted(used) == sorted(replies) and len(used) == len(demos)
    with pytest.raises(InputError, match="max_sub_turns=2"):
        make_task({"name": "research", "max_sub_turns": 2}).demonstrations(env.problems()[0])


def test_a_resumed_run_trains_at_its_own_learning_rate_not_the_checkpoints(tmp_path):
    """``teamrl sft ... train.lr=A`` then ``teamrl train ... train.lr=B --resume``: the optimizer state comes
    from the checkpoint, the rate and weight decay from the run's config (they were the checkpoint's, silently)."""
    from teamrl.tasks import make_task
    from teamrl.trainer.trainer import Trainer

    cfg = _cfg(tmp_path)  # train.lr=1e-2
    task = make_task(cfg.task)
    warm_start(cfg, task_demonstrations(task, task.problems()[:1]), epochs=1, batch_size=6, progress=False)
    trainer = Trainer(_cfg(tmp_path, "train.lr=3e-4", "train.weight_decay=0.01"), resume=True)
    group = trainer.router.policies["shared"].optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (3e-4, 0.01)


LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}


def test_a_tool_call_demonstration_renders_as_the_gateway_renders_and_parses_it(tmp_path, tiny):
    """Issue 56 item 1: `teamrl sft`'s JSONL had no `tools`, so a tool-using agent could not be warm-started to call
    a tool. A row may now give `tools` (rendered into the prompt as the gateway renders a request offering them),
    earlier tool calls and results in `messages`, and the completion as an assistant message with `tool_calls`:
    it is trained as the text the gateway's parser reads back as that call."""
    from teamrl.policies.chat import encode_chat
    from teamrl.rollout.tool_calls import hermes, parse_tool_calls, tool_choice
    from teamrl.trainer.sft import encode_demonstration

    _, tok = tiny
    rows = tmp_path / "tools.jsonl"
    messages = [{"role": "user", "content": "Who wrote it?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"key\": \"a\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "not found"}]
    rows.write_text(json.dumps({"role": "planner", "messages": messages, "tools": [LOOKUP],
                                "completion": {"tool_calls": [{"type": "function", "function": {
                                    "name": "lookup", "arguments": {"key": "b"}}}]}}) + "\n")
    (d,) = load_demonstrations(rows)
    assert d.tools == [LOOKUP]
    parse = parse_tool_calls(d.completion, hermes, tool_choice([LOOKUP], None))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parse.calls] == [("lookup", {"key": "b"})]
    prompt_ids, completion_ids = encode_demonstration(tok, d)
    assert prompt_ids == encode_chat(tok, messages, [LOOKUP]) and "lookup" in tok.decode(prompt_ids)
    assert completion_ids[-1] == tok.eos_token_id
    rows.write_text(json.dumps({"role": "planner", "messages": "q", "tools": {"name": "x"}, "completion": "a"}) + "\n")
    with pytest.raises(InputError, match="tools.jsonl:1: tools .* must be a list of"):
        load_demonstrations(rows)

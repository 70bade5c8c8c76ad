"""A solver -> reviewer team written only against the `openai` package, trained through teamrl's gateway.

The episode function is ordinary OpenAI-client code: each `model=` names a role, and teamrl trains
one adapter per role on exactly the tokens it sampled for these calls.

Train it:   teamrl train examples/openai_team.yaml --plugin examples/openai_team.py
Run it once against any OpenAI-compatible server (no teamrl involved):
            python examples/openai_team.py http://127.0.0.1:8000/v1 solver-model reviewer-model
"""
import re
import sys

import openai


def last_number(text):
    found = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return found[-1] if found else None


def episode(problem, client: openai.OpenAI, models=None):
    """Solve, review, answer; the reward is the reviewer's final answer's correctness (the solver's own, too)."""
    solver, reviewer = models or ("solver", "reviewer")
    question = f"{problem['question']}\n{problem['answer_instruction']}"
    draft = client.chat.completions.create(model=solver, messages=[{"role": "user", "content": question}])
    draft_text = draft.choices[0].message.content
    review = client.chat.completions.create(model=reviewer, messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": draft_text},
        {"role": "user", "content": "Check this solution step by step, fix any mistake, and give the final answer."},
    ])
    truth = str(problem["data"]["answer"])
    correct = last_number(review.choices[0].message.content) == truth
    return {"reward": float(correct), "roles": {"solver": float(last_number(draft_text) == truth)}, "correct": correct}


try:  # registered when teamrl loads this file as a plugin
    from teamrl.api import openai_workflow

    openai_workflow("openai_team", roles=("solver", "reviewer"))(episode)
except ImportError:  # plain openai use, without teamrl installed
    pass

if __name__ == "__main__":
    url, solver_model, reviewer_model = sys.argv[1:4]
    problem = {"question": "Problem:\nWhat is 17 + 25?", "answer_instruction": "End with one line `Answer: <value>`.",
               "data": {"answer": 42}}
    print(episode(problem, openai.OpenAI(base_url=url, api_key="none"), (solver_model, reviewer_model)))

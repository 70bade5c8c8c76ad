"""A scripted coder for the coder + critic team (examples/coder_critic.py): it reads the numbers and the operation
off math.solve's easy word problems and writes the one-line program. On SmolLM2-135M the untrained team never
succeeds (teamrl calibrate: every reward 0 at 4 settings), so its own successes cannot be the warm start; this
player's can, with the critic's replies sampled from the model:

    teamrl sft examples/coder_critic.yaml --plugin examples/coder_critic.py --self-play 4 --problems 32 \\
        --player examples/coder_critic_player.py:coder --player-roles coder name=coder_critic_ws
    teamrl train examples/coder_critic.yaml --plugin examples/coder_critic.py name=coder_critic_ws --resume
"""
import re

# math.solve's generated_easy templates: "... gets B more", "... gives away B", "There are A bags with B ... in each"
OPERATIONS = (("gives away", "-"), ("bags with", "*"))


def coder(role: str, messages: list[dict]) -> str:
    """The coder's reply to either of its prompts (the draft and the revision): the problem is the line after
    ``Problem:``."""
    question = messages[-1]["content"].split("Problem:\n", 1)[-1].split("\n")[0]
    a, b = re.findall(r"\d+", question)[:2]
    op = next((sign for words, sign in OPERATIONS if words in question), "+")
    return f"```python\nprint({a} {op} {b})\n```"

import os

# Tests never reach a model hub, and one thread keeps them deterministic and polite on 2 cores.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import contextlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def tiny():
    """(model, tokenizer) of the tiny-random alias."""
    from teamrl.policies.models import load_model

    return load_model("tiny-random", seed=0)


@pytest.fixture
def tiny_engine(tiny):
    from teamrl.rollout.hf_engine import HFEngine

    model, tok = tiny
    return HFEngine(lambda policy: contextlib.nullcontext(model), tok)


# Files with a test that took 8 s or more (make test --durations, 2026-12-08), longest first: they run first, so that the
# two xdist workers end on short tests together instead of one waiting out a long test that happened to come last.
# Whole files move (their module fixtures are set up once); a file missing here keeps its place.
SLOW_FIRST = (
    "tests/test_lint.py",
    "tests/test_learning_bench.py",
    "tests/test_no_signal_step.py",
    "tests/test_models.py",
    "tests/test_rollout_pool.py",
    "tests/test_mgrpo.py",
    "tests/test_sharded_learner.py",
    "tests/test_placement.py",
    "tests/test_gateway_limits.py",
    "tests/test_serve_limits.py",
    "tests/test_extension_api.py",
    "tests/test_agent_frameworks.py",
    "tests/test_sandbox_escape.py",
    "tests/test_cli_hostile.py",
    "tests/test_async_rollout.py",
    "tests/test_docs.py",
    "tests/test_gateway_load.py",
    "tests/test_newcomer_teams.py",
    "tests/test_study.py",
    "tests/test_shipped_configs.py",
    "tests/test_vllm_server.py",
    "tests/test_trainer.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order

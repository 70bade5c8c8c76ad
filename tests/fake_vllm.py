"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in the main suite (tests/test_vllm_server.py).

Takes the flags teamrl's managed server passes (an unknown one fails, as vLLM's parser would), writes them and
the environment it got to ``$FAKE_VLLM_RECORD`` (JSON), starts a child that stands for vLLM's engine core (its
command line holds ``$FAKE_VLLM_MARKER``; it outlives a killed parent, as vLLM's does), then serves with
``teamrl serve --strict vllm``. ``$FAKE_VLLM_MODE``: ``fail`` dies at start-up the way vLLM does (a traceback
ending in an exception line); ``hang`` never answers (for the kill tests).
"""

import argparse
import json
import os
import subprocess
import sys
import time

p = argparse.ArgumentParser()
for flag in ("--model", "--served-model-name", "--dtype", "--max-loras", "--max-lora-rank", "--logprobs-mode", "--host",
             "--port", "--max-model-len", "--gpu-memory-utilization"):
    p.add_argument(flag, required=flag not in ("--gpu-memory-utilization",))
p.add_argument("--enable-lora", action="store_true")
ns = p.parse_args()
record = os.environ.get("FAKE_VLLM_RECORD")
if record:
    with open(record, "w") as f:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid(),
                   "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}, f)
mode = os.environ.get("FAKE_VLLM_MODE", "")
if mode == "fail":
    print("INFO 12-02 08:29:20 [api_server.py:1] vLLM API server version 0.32.0", flush=True)
    print("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>", flush=True)
    print(f"(APIServer pid={os.getpid()}) ValueError: LoRA rank {ns.max_lora_rank} is not supported here", flush=True)
    print("Engine core initialization failed. See root cause above.", flush=True)
    sys.exit(1)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", os.environ.get("FAKE_VLLM_MARKER", "fake-vllm-core")])
if mode == "hang":
    while True:
        time.sleep(1)
from teamrl.cli import main  # noqa: E402

sys.exit(main(["serve", "--strict", "vllm", "--logprobs-mode", ns.logprobs_mode, "--model", ns.model, "--served-model-name",
               ns.served_model_name, "--host", ns.host, "--port", ns.port, "--dtype", ns.dtype, "--threads", "1",
               "--allowed-path", "/",  # vLLM loads adapters from any folder: so does its stand-in
               # vLLM takes its key from VLLM_API_KEY as from --api-key
               *(("--api-key", os.environ["VLLM_API_KEY"]) if os.environ.get("VLLM_API_KEY") else ())]))

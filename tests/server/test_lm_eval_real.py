"""lm-evaluation-harness against a real `prefixserve serve` process, offline: its `local-completions`
model with `tokenizer_backend=remote` reads GET /tokenizer_info and POST /tokenize
(`add_special_tokens: false`) / /detokenize, then scores every choice of a small multiple-choice task
through /v1/completions (`echo` + `logprobs`, token-id prompts). The task and its data set are made
by tests/helpers/lm_eval_task.py (a task YAML over a local jsonl file, shared with
bench/lm_eval_peer.py); no tokenizer file, no network (HF_*_OFFLINE=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.lm_eval_task import FACTS, MC_TASK, write_mc_task
from tests.helpers.server_proc import ServerProcess, server_fixture

pytestmark = pytest.mark.slow

KEY = "sk-eval-0123456789"
server = server_fixture(["--api-key", KEY, "--no-ledger"], scope="module")

def test_lm_eval_local_completions_with_the_remote_tokenizer(server: ServerProcess, tmp_path: Path) -> None:
    write_mc_task(tmp_path)
    models = httpx.get(server.openai_url + "/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    model = models.json()["data"][0]["id"]  # the served name, which lm-eval's `model=` must give
    hf = tmp_path / "hf"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf),
           "HF_DATASETS_CACHE": str(hf / "datasets"), "OPENAI_API_KEY": KEY, "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    args = (f"model={model},base_url={server.openai_url}/completions,tokenizer_backend=remote,"
            f"num_concurrent=1,auth_token={KEY}")
    lm_eval = Path(sys.executable).with_name("lm_eval")
    run = subprocess.run([str(lm_eval), "run", "--model", "local-completions", "--model_args", args,
                          "--tasks", MC_TASK, "--include_path", str(tmp_path), "--output_path", str(out)],
                         check=False, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    [results_file] = out.rglob("results*.json")
    results = json.loads(results_file.read_text())
    acc = results["results"][MC_TASK]["acc,none"]
    print(f"lm-eval {MC_TASK}: acc {acc:.3f}")
    assert 0.0 <= acc <= 1.0 and results["n-samples"][MC_TASK]["effective"] == len(FACTS)
    assert MC_TASK in run.stdout and "acc" in run.stdout  # the table it prints
    log = server.log_text()  # it used our tokenizer endpoints, with the key
    for line in ('"GET /tokenizer_info HTTP/1.1" 200', '"POST /tokenize HTTP/1.1" 200',
                 '"POST /v1/completions HTTP/1.1" 200'):
        assert line in log, line
    assert " 401 " not in log and '" 400 ' not in log

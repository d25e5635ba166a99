"""lm-evaluation-harness against a real `prefixserve serve` process, offline: its `local-completions`
model with `tokenizer_backend=remote` reads GET /tokenizer_info and POST /tokenize
(`add_special_tokens: false`) / /detokenize, then scores every choice of a small multiple-choice task
through /v1/completions (`echo` + `logprobs`, token-id prompts). The task and its data set are made
here (a task YAML over a local jsonl file); no tokenizer file, no network (HF_*_OFFLINE=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers.server_proc import ServerProcess, server_fixture

pytestmark = pytest.mark.slow

KEY = "sk-eval-0123456789"
TASK = "prefixserve_local_mc"
server = server_fixture(["--api-key", KEY, "--no-ledger"], scope="module")

FACTS = [  # (question, right answer, three wrong ones)
    ("What is the capital of France?", "Paris", "Banana", "Seven", "Blue"),
    ("What is the capital of Germany?", "Berlin", "Winter", "Chair", "Nine"),
    ("What is the capital of Italy?", "Rome", "Pencil", "Cloud", "Ocean"),
    ("What is the capital of Spain?", "Madrid", "Spoon", "Thunder", "Green"),
    ("What is the capital of Japan?", "Tokyo", "Carrot", "Window", "Four"),
    ("What colour is the sky on a clear day?", "Blue", "Loud", "Square", "Wednesday"),
    ("How many legs does a dog have?", "Four", "Purple", "Forty", "Zero"),
    ("What do bees make?", "Honey", "Bricks", "Music", "Iron"),
    ("Which animal says moo?", "A cow", "A fish", "A rock", "A spoon"),
    ("What is frozen water called?", "Ice", "Sand", "Smoke", "Paper"),
    ("Which planet do we live on?", "Earth", "Tuesday", "Apple", "Violin"),
    ("What is two plus two?", "Four", "Eleven", "Blue", "Cat"),
    ("What do you use to write on paper?", "A pen", "A cloud", "A river", "A shoe"),
    ("Which season is the coldest?", "Winter", "Pizza", "Guitar", "Copper"),
    ("What is the opposite of hot?", "Cold", "Table", "Seven", "Dog"),
    ("What fruit is yellow and long?", "Banana", "Hammer", "Moon", "Tiger"),
    ("Where do fish live?", "In water", "In fire", "In clocks", "In books"),
    ("What does a clock tell?", "The time", "A joke", "The weight", "A colour"),
    ("Which star gives Earth its daylight?", "The Sun", "The Moon", "A candle", "A lamp"),
    ("How many days are in a week?", "Seven", "Twelve", "Two", "Ninety"),
]


def write_task(folder: Path) -> None:
    """A multiple-choice task over 20 local questions, the right answer at varying positions."""
    rows = []
    for i, (question, right, *wrong) in enumerate(FACTS):
        choices = list(wrong)
        choices.insert(i % 4, right)
        rows.append({"question": question, "choices": choices, "answer": i % 4})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )


def test_lm_eval_local_completions_with_the_remote_tokenizer(server: ServerProcess, tmp_path: Path) -> None:
    write_task(tmp_path)
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
                          "--tasks", TASK, "--include_path", str(tmp_path), "--output_path", str(out)],
                         check=False, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    [results_file] = out.rglob("results*.json")
    results = json.loads(results_file.read_text())
    acc = results["results"][TASK]["acc,none"]
    print(f"lm-eval {TASK}: acc {acc:.3f}")
    assert 0.0 <= acc <= 1.0 and results["n-samples"][TASK]["effective"] == len(FACTS)
    assert TASK in run.stdout and "acc" in run.stdout  # the table it prints
    log = server.log_text()  # it used our tokenizer endpoints, with the key
    for line in ('"GET /tokenizer_info HTTP/1.1" 200', '"POST /tokenize HTTP/1.1" 200',
                 '"POST /v1/completions HTTP/1.1" 200'):
        assert line in log, line
    assert " 401 " not in log and '" 400 ' not in log

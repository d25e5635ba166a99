"""The 20-question local task that lm-eval scores against a server, written as lm-eval task YAMLs over
local jsonl files (no Hub, no network). Shared by tests/server/test_lm_eval_real.py (the log-likelihood
form) and bench/lm_eval_peer.py (both forms, against prefixserve and llama.cpp's server).

Two forms of the same questions, the right answer at the same position in each:
- `write_mc_task`: `output_type: multiple_choice`, every choice scored by its log-likelihood
  (completions' `echo` + `logprobs`), metric `acc`;
- `write_gen_task`: `output_type: generate_until`, the prompt lists the choices as A-D and asks for the
  letter; greedy, until a newline, a few tokens; metric `exact_match` on the first letter A-D of the
  reply (filter `letter`). A server without `echo` (llama.cpp's llama-server) can run only this one.
"""

from __future__ import annotations

import json
from pathlib import Path

MC_TASK = "prefixserve_local_mc"
GEN_TASK = "prefixserve_local_gen"
LETTERS = "ABCD"

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

# One worked example before each generative question (not one of the 20), so that a small model
# answers with a letter at all; the same text goes to every server.
GEN_EXAMPLE = "Question: What colour is grass?\nA. Red\nB. Green\nC. Loud\nD. Nine\nAnswer: B\n\n"


def rows() -> list[dict]:
    """The 20 questions, the right answer at position i % 4 among the four choices."""
    out = []
    for i, (question, right, *wrong) in enumerate(FACTS):
        choices = list(wrong)
        choices.insert(i % 4, right)
        out.append({"question": question, "choices": choices, "answer": i % 4})
    return out


def _metric(name: str, extra: str = "") -> str:
    return f"metric_list:\n  - metric: {name}\n    aggregation: mean\n    higher_is_better: true\n{extra}"


def write_mc_task(folder: Path, task: str = MC_TASK) -> Path:
    """The log-likelihood multiple-choice form: `folder/<task>.yaml` over `folder/<task>.jsonl`."""
    return _write_task(folder, task, rows(), "multiple_choice",
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n" + _metric("acc")
    )


def _write_task(folder: Path, task: str, docs: list[dict], output_type: str, rest: str) -> Path:
    """`folder/<task>.jsonl` holding `docs`, and `folder/<task>.yaml`: the head every local task shares, then `rest`."""
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    yaml = folder / f"{task}.yaml"
    yaml.write_text(
        f"task: {task}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        f"output_type: {output_type}\n" + rest
    )
    return yaml


def gen_prompt(question: str, choices: list[str]) -> str:
    listed = "".join(f"{letter}. {choice}\n" for letter, choice in zip(LETTERS, choices, strict=True))
    return f"{GEN_EXAMPLE}Question: {question}\n{listed}Answer:"


def write_gen_task(folder: Path, task: str = GEN_TASK) -> Path:
    """The generative form of the same questions: the reply's first letter A-D against the answer's."""
    docs = [{"prompt": gen_prompt(r["question"], r["choices"]), "letter": LETTERS[r["answer"]]} for r in rows()]
    return _write_task(folder, task, docs, "generate_until",
        'doc_to_text: "{{prompt}}"\n'
        "doc_to_target: letter\n"
        "generation_kwargs:\n"
        '  until: ["\\n"]\n'
        "  max_gen_toks: 4\n"
        "  do_sample: false\n"
        "  temperature: 0\n"
        "filter_list:\n"
        "  - name: letter\n"
        "    filter:\n"
        "      - function: regex\n"
        '        regex_pattern: "([ABCD])"\n'
        "      - function: take_first\n"
        + _metric("exact_match", "    ignore_case: false\n    ignore_punctuation: true\n")
    )

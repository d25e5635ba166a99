"""The prepared-model cache (models/loaders/prepared.py): a cached load gives the same tensors, bit for bit,
and a tokenizer that behaves the same; a damaged entry is dropped, never used."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from prefixserve.models import load_model
from prefixserve.models.arch import ModelLoadError
from prefixserve.models.layers import TilePlan
from prefixserve.models.llama.decoder import Decoder
from prefixserve.models.loaders import prepared
from prefixserve.models.loaders.load import LoadedModel, embedded_model_path
from prefixserve.models.tokenizer import Tokenizer
from prefixserve.runner import ModelRunner, StepItem

MESSAGES = [
    [{"role": "system", "content": "You are helpful. Ünïcode ✓ 日本語"}, {"role": "user", "content": "Hi <|im_end|>\n\n  x"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}, {"role": "user", "content": "?"}],
]
TEXTS = ["Hello  world\t\n日本", "", " leading space", "<|im_start|>user\nhi<|im_end|>", "emoji 🎉🎉 and \u200b"]


def _tensors(d: Decoder) -> list[tuple[str, torch.Tensor]]:
    out = [("embed", d.embed), ("lm_head", d.lm_head), ("final_norm", d.final_norm)]
    for i, lw in enumerate(d.layers):
        for name in ("attn_norm", "qkv", "qkv_bias", "o_proj", "mlp_norm", "gate_up", "down", "q_norm", "k_norm"):
            t = getattr(lw, name)
            if t is not None:
                out.append((f"{i}.{name}", t))
        for name in ("qkv_q4", "o_q4", "gate_up_q4", "down_q4"):
            w = getattr(lw, name)
            for j, (packed, sz) in enumerate(w.parts if w is not None else []):
                out += [(f"{i}.{name}.{j}.packed", packed), (f"{i}.{name}.{j}.sz", sz)]
    for j, (packed, sz) in enumerate(d.lm_head_q4.parts if d.lm_head_q4 is not None else []):
        out += [(f"head_q4.{j}.packed", packed), (f"head_q4.{j}.sz", sz)]
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("model-cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)  # ~360 MB: not left for pytest's kept temp dirs


@pytest.fixture(scope="module")
def fresh_and_cached(cache_dir: Path) -> tuple[LoadedModel, LoadedModel]:
    """The first load prepares from the GGUF (exactly the uncached path) and stores; the second hits."""
    fresh = load_model(None, torch.bfloat16, cache_dir=str(cache_dir))
    assert len(os.listdir(cache_dir)) == 1
    cached = load_model(None, torch.bfloat16, cache_dir=str(cache_dir))
    return fresh, cached


def test_cached_load_is_bitwise_the_prepared_one(fresh_and_cached: tuple[LoadedModel, LoadedModel]) -> None:
    fresh, cached = fresh_and_cached
    assert cached.arch == fresh.arch
    assert cached.decoder.int4_decode == fresh.decoder.int4_decode
    assert (cached.decoder.lm_head is cached.decoder.embed) == (fresh.decoder.lm_head is fresh.decoder.embed)
    a, b = _tensors(fresh.decoder), _tensors(cached.decoder)
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    # and it runs: the same logits from the same prompt
    ids = cached.tokenizer.render_chat(MESSAGES[0])
    logits = []
    for m in (fresh, cached):
        runner = ModelRunner(m.decoder)
        st = runner.new_state(len(ids) + 1)
        runner.step([StepItem(st, ids)])
        runner.step([StepItem(st, [int(torch.argmax(st.logits))], decode=True)])
        logits.append(st.logits)
    assert torch.equal(logits[0], logits[1])


def test_cached_tokenizer_behaves_the_same(fresh_and_cached: tuple[LoadedModel, LoadedModel]) -> None:
    fresh, cached = fresh_and_cached
    assert cached.tokenizer.eos_token_ids == fresh.tokenizer.eos_token_ids
    assert cached.tokenizer.vocab_size == fresh.tokenizer.vocab_size
    assert cached.tokenizer.hf.chat_template == fresh.tokenizer.hf.chat_template
    for text in TEXTS:
        ids = fresh.tokenizer.encode(text)
        assert cached.tokenizer.encode(text) == ids
        assert cached.tokenizer.decode(ids) == fresh.tokenizer.decode(ids)
    for messages in MESSAGES:
        assert cached.tokenizer.render_chat(messages) == fresh.tokenizer.render_chat(messages)


def _entry(cache_dir: Path) -> Path:
    (name,) = [n for n in os.listdir(cache_dir) if not n.startswith(".")]
    return cache_dir / name


def _parts() -> dict[str, str]:
    return prepared.key_parts(prepared.file_identity(embedded_model_path()), torch.bfloat16, "cpu", True)


@pytest.mark.parametrize("damage", ["bit-flip", "truncate", "manifest"])
def test_a_damaged_entry_is_dropped_never_used(
    damage: str, fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fresh, _ = fresh_and_cached
    parts = _parts()
    prepared.save(str(tmp_path), parts, fresh.decoder, fresh.tokenizer)
    entry = _entry(tmp_path)
    payload = entry / "tensors.pt"
    if damage == "bit-flip":
        with open(payload, "r+b") as f:
            f.seek(payload.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    elif damage == "truncate":
        os.truncate(payload, payload.stat().st_size - 4096)
    else:
        manifest = json.loads((entry / "manifest.json").read_text())
        manifest["key"]["dtype"] = "torch.float32"  # an entry claiming to be another one
        (entry / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="prefixserve.models"):
        assert prepared.load(str(tmp_path), parts, TilePlan()) is None
    assert "dropping" in caplog.text
    assert not entry.exists()


def test_key_covers_what_changes_the_bits() -> None:
    base = _parts()
    keys = {prepared.entry_key(base)}
    for change in ({"dtype": "torch.float32"}, {"int4": "False"}, {"model": "0" * 32}, {"torch": "0.0"},
                   {"cpu_capability": "a capability no CPU has"}, {"code": "x"}):
        keys.add(prepared.entry_key({**base, **change}))
    assert len(keys) == 7
    assert prepared.entry_key(dict(reversed(list(base.items())))) == prepared.entry_key(base)


def test_entries_are_bounded_least_recent_out(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh, _ = fresh_and_cached
    monkeypatch.setattr(prepared, "_tensors", lambda decoder: {"w": torch.zeros(4)})  # small entries
    names = []
    for i in range(prepared.MAX_ENTRIES + 2):
        parts = {**_parts(), "model": f"{i:032d}"}
        prepared.save(str(tmp_path), parts, fresh.decoder, fresh.tokenizer)
        entry = tmp_path / prepared.entry_key(parts)
        os.utime(entry / "manifest.json", (1000 + i, 1000 + i))
        names.append(entry.name)
    assert sorted(os.listdir(tmp_path)) == sorted(names[-prepared.MAX_ENTRIES:])


def test_the_tokenizer_is_made_while_the_tensors_are_written(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start converts the tokenizer on its own thread while another writes the tensors: each
    side here waits until the other has begun, which only a write beside the conversion lets end."""
    fresh, _ = fresh_and_cached
    writing, converting = threading.Event(), threading.Event()

    def tensors(decoder: Decoder) -> dict[str, torch.Tensor]:
        writing.set()
        assert converting.wait(20), "the tokenizer was not being made while the tensors were written"
        return {"w": torch.zeros(4)}

    def make_tokenizer() -> Tokenizer:
        converting.set()
        assert writing.wait(20), "the tensors were not being written while the tokenizer was made"
        return fresh.tokenizer

    monkeypatch.setattr(prepared, "_tensors", tensors)
    parts = _parts()
    assert prepared.save_while(str(tmp_path), parts, fresh.decoder, make_tokenizer) is fresh.tokenizer
    entry = tmp_path / prepared.entry_key(parts)
    assert sorted(os.listdir(tmp_path)) == [entry.name]  # complete, renamed into place, no temporary left
    assert {"manifest.json", "tensors.pt", "tokenizer"} <= set(os.listdir(entry))


def test_a_tokenizer_that_fails_leaves_no_entry_and_no_writer(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh, _ = fresh_and_cached
    monkeypatch.setattr(prepared, "_tensors", lambda decoder: {"w": torch.zeros(1 << 20)})

    def make_tokenizer() -> Tokenizer:
        raise ModelLoadError("the vocabulary does not parse")

    with pytest.raises(ModelLoadError, match="vocabulary"):
        prepared.save_while(str(tmp_path), _parts(), fresh.decoder, make_tokenizer)
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name == "prefixserve-prepared-save"]


def test_a_write_that_fails_is_logged_and_the_model_still_loads(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh, _ = fresh_and_cached

    def tensors(decoder: Decoder) -> dict[str, torch.Tensor]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepared, "_tensors", tensors)
    with caplog.at_level(logging.WARNING, logger="prefixserve.models"):
        assert prepared.save_while(str(tmp_path), _parts(), fresh.decoder, lambda: fresh.tokenizer) is fresh.tokenizer
    assert "cannot store" in caplog.text and "No space left" in caplog.text
    assert os.listdir(tmp_path) == []


def test_a_store_left_for_later_writes_the_model_as_prepared(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path
) -> None:
    """`prefixserve serve` stores a model it prepared anew once it serves (`later`): until the job runs
    there is no entry (its tokenizer waits in a temporary directory), and the job stores the tensors as
    they were prepared, whatever the loader did to the decoder since; a later load gives them bit for bit."""
    _, cached = fresh_and_cached
    jobs: list = []
    loaded = load_model(None, torch.bfloat16, cache_dir=str(tmp_path), later=jobs.append)
    assert len(jobs) == 1
    (tmp,) = os.listdir(tmp_path)
    assert tmp.startswith(".tmp-") and os.listdir(tmp_path / tmp) == ["tokenizer"]
    layer = loaded.decoder.layers[0]
    layer.qkv = torch.zeros_like(layer.qkv)  # replaced after preparing (as fp32 copies replace them)
    jobs[0]()
    (entry,) = os.listdir(tmp_path)
    assert {"manifest.json", "tensors.pt", "tokenizer"} <= set(os.listdir(tmp_path / entry))
    again = load_model(None, torch.bfloat16, cache_dir=str(tmp_path))
    want, got = _tensors(cached.decoder), _tensors(again.decoder)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(want, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids = cached.tokenizer.encode(TEXTS[0])
    assert again.tokenizer.encode(TEXTS[0]) == ids


def test_a_store_left_for_later_that_fails_is_logged_and_leaves_nothing(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh, _ = fresh_and_cached
    monkeypatch.setattr(prepared, "_tensors", lambda decoder: {"w": torch.zeros(4)})

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(prepared, "_finish", full)
    job = prepared.save_later(str(tmp_path), _parts(), fresh.decoder, fresh.tokenizer)
    assert job is not None
    with caplog.at_level(logging.WARNING, logger="prefixserve.models"):
        job()  # a background thread's job: never raises
    assert "cannot store" in caplog.text and "No space left" in caplog.text
    assert os.listdir(tmp_path) == []


def test_a_dead_processs_temporary_directory_is_removed_a_live_ones_kept(
    fresh_and_cached: tuple[LoadedModel, LoadedModel], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed while storing leaves its temporary directory (380 MB for the embedded model);
    the next store removes those untouched for STALE_TMP_S, and leaves a running store's alone."""
    fresh, _ = fresh_and_cached
    monkeypatch.setattr(prepared, "_tensors", lambda decoder: {"w": torch.zeros(4)})
    dead, live = tmp_path / ".tmp-dead", tmp_path / ".tmp-live"
    for d in (dead, live):
        d.mkdir()
        (d / "tensors.pt").write_bytes(b"x" * 1000)
    old = dead.stat().st_mtime - prepared.STALE_TMP_S - 60
    os.utime(dead, (old, old))
    job = prepared.save_later(str(tmp_path), _parts(), fresh.decoder, fresh.tokenizer)
    assert job is not None
    job()
    names = os.listdir(tmp_path)
    assert ".tmp-dead" not in names and ".tmp-live" in names and prepared.entry_key(_parts()) in names

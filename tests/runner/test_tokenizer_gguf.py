"""A GGUF's tokenizer built without AutoTokenizer's second parse of the file is AutoTokenizer's own,
the loader's header reader gives what the `gguf` package's reader gives, and its dequantisation the same bits."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from prefixserve.models.loaders.gguf import read_gguf
from prefixserve.models.loaders.load import embedded_model_path
from prefixserve.models.tokenizer import GENERIC_TOKENIZER_ARCHS, load_tokenizer_gguf

TEXTS = ["", "Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — ünïcödé 你好 🙂👍🏽",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> <repo_name> <file_sep>", "x" * 300,
         "def f(a, b):\n    return a**2 + b  # comment", "1234567890 3.14159 -42 1e-5", "\u0000\u00a0\u2028"]


@pytest.fixture(scope="module")
def pair() -> tuple[object, object]:
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    auto = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return auto, load_tokenizer_gguf(path).hf


def test_the_mapping_the_shortcut_relies_on_holds() -> None:
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    for arch in GENERIC_TOKENIZER_ARCHS:
        assert TOKENIZER_MAPPING_NAMES.get(arch) in (None, "TokenizersBackend"), arch


def test_same_tokenizer_as_autotokenizer(pair: tuple) -> None:
    auto, ours = pair
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.chat_template == auto.chat_template
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.added_tokens_decoder == auto.added_tokens_decoder
    assert ours.init_kwargs == auto.init_kwargs
    assert len(ours) == len(auto) and ours.get_vocab() == auto.get_vocab()
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text), text
        assert ours.encode(text, add_special_tokens=False, split_special_tokens=True) == \
            auto.encode(text, add_special_tokens=False, split_special_tokens=True), text
        ids = auto.encode(text)
        assert ours.decode(ids) == auto.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_a_tokenizer_config_beside_the_file_goes_through_autotokenizer(tmp_path: Path) -> None:
    """A tokenizer_config.json could name another class: then AutoTokenizer decides (it still loads)."""
    path = tmp_path / "m.gguf"
    os.symlink(embedded_model_path(), path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    from prefixserve.models import tokenizer

    assert tokenizer._gguf_tokenizer_class(str(tmp_path), "llama") is None
    assert tokenizer._gguf_tokenizer_class(str(tmp_path.parent), "qwen2") is None
    assert tokenizer._gguf_tokenizer_class(os.path.dirname(embedded_model_path()), "llama") is not None


def test_header_reader_matches_the_gguf_package() -> None:
    gguf = pytest.importorskip("gguf")
    path = embedded_model_path()
    meta, tensors = read_gguf(path)
    reader = gguf.GGUFReader(path, "r")
    assert meta == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert len(tensors) == len(reader.tensors)
    for ours, theirs in zip(tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type, ours.shape) == (theirs.name, int(theirs.tensor_type),
                                                             tuple(int(d) for d in theirs.shape))
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_dequantisation_matches_the_gguf_package_bit_for_bit() -> None:
    gguf = pytest.importorskip("gguf")
    from prefixserve.models.loaders.gguf import dequantize

    _, tensors = read_gguf(embedded_model_path())
    kinds = set()
    for t in tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        ours, theirs = dequantize(t.data, qtype), gguf.quants.dequantize(t.data, qtype)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, t.name
        assert np.array_equal(ours.view(np.uint32), np.asarray(theirs).view(np.uint32)), t.name
        kinds.add(qtype.name)
    assert {"Q4_1", "F32"} <= kinds
    rng = np.random.default_rng(0)
    for name in ("Q4_0", "Q8_0", "Q4_1"):  # the other tested block types, from random data of 40 rows
        qtype = gguf.GGMLQuantizationType[name]
        raw = gguf.quants.quantize(rng.standard_normal((40, 64)).astype(np.float32), qtype)
        assert np.array_equal(dequantize(raw, qtype).view(np.uint32), gguf.quants.dequantize(raw, qtype).view(np.uint32))

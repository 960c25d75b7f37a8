"""Incremental detokenization gives exactly the text of decoding all output ids at once."""
import random

import pytest

from prefixcache.engine.detokenizer import Detokenizer
from prefixcache.models.catalog import default_model_path
from prefixcache.models.loader import tokenizer as load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_incremental_text_equals_whole_decode(tokenizer):
    rng = random.Random(0)
    texts = ["Hello, world! Prefix caching keeps KV.", "naïve café — 日本語のテキスト 🙂🚀 done.",
             "  leading spaces\n\nand\ttabs", "<|im_start|>user\nHi<|im_end|>"]
    streams = [tokenizer.encode(t) for t in texts]
    streams += [[rng.randrange(tokenizer.vocab_size) for _ in range(200)] for _ in range(20)]  # any ids at all
    for ids in streams:
        d = Detokenizer(tokenizer)
        pieces = [d.add(t) for t in ids]
        pieces.append(d.flush())
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == d.text == whole


def test_an_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # a multi-byte emoji spans tokens
    d = Detokenizer(tokenizer)
    assert [d.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "🙂"

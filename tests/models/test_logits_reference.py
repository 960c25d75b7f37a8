"""Every kernel build on this machine gives the stored reference's bits (tests/logits_reference.py: written by the
AVX-512 build), for each way of running the prompts: alone or batched, cold or warm, whole or in chunks."""
import json

import pytest
from logits_reference import PATH, models, runs

from prefixcache import kernels
from prefixcache.models import gguf_file
from prefixcache.models.catalog import model_path

with open(PATH) as f:
    REFERENCE = json.load(f)


@pytest.mark.skipif(not kernels.supported(), reason=f"kernels: {kernels.choose('auto').status}")
@pytest.mark.parametrize("isa", kernels.supported())
@pytest.mark.parametrize("name", models())
def test_each_build_gives_the_reference_bits(name, isa):
    stored = REFERENCE["models"][name]
    assert gguf_file.file_digest(model_path(name)) == stored["file_digest"], (
        f"{name}'s file is not the one the reference was written from: `make logits-reference` on an AVX-512 CPU")
    expected = [(t, d) for t, d in zip(stored["tokens"], stored["digests"])]
    for way, got in runs(name, isa, stored["prompts"]).items():
        assert got == expected, f"{name} on {isa}, {way}: not the {REFERENCE['written_by']} build's bits"

"""The start-up check of the weights read as shipped (models/kernel_check.py shipped, models/probe.py): weights whose
blocks it finds wrong are read as fp32 (a tied LM head's rows by the embedding too), a piece of a weight at a time,
and its verdict is kept per file's bytes and library."""
import dataclasses

import torch
from conftest import GREEDY
from test_quant import needs_kernels

from prefixcache import LLM, kernels
from prefixcache.models import kernel_check, layouts, probe, quant
from prefixcache.models.rowwise import Part


def _misread(monkeypatch, part: Part, at: tuple[int, int, int]) -> torch.Tensor:
    """A kernel misreading a weight, simulated: a bit of its blocks changed at `at`, their reference values (of the
    part, or of a piece of it the check takes) not. Returns the blocks as they were."""
    original = part.data.clone()
    part.data[at] ^= 1
    values = Part.values.fget

    def reference(p: Part) -> torch.Tensor:
        if p.data.untyped_storage().data_ptr() != part.data.untyped_storage().data_ptr():
            return values(p)
        first = (p.data.data_ptr() - part.data.data_ptr()) // part.data[0].nbytes  # the piece's first panel
        return values(dataclasses.replace(p, data=original[first:first + len(p.data)]))
    monkeypatch.setattr(Part, "values", property(reference))
    return original


@needs_kernels
def test_weights_whose_blocks_differ_from_their_values_are_read_as_fp32(monkeypatch, caplog):
    """A kernel misreading layer 17's down_proj (simulated: its blocks changed by a bit, their reference values
    not): the start-up check finds that weight alone, which is read as fp32 panels from then on, the status and the
    log say so, and the output is the unchanged model's."""
    llm = LLM(enable_prefix_cache=False)
    model = llm.engine.runner.model
    assert "weights read as shipped (Q4_1/Q8_0" in llm.exactness.kernels and "fp32 panels" not in llm.exactness.kernels
    part = model.layers[17]["down"].parts[0]
    original = _misread(monkeypatch, part, (3, 5, 100))
    status = probe._shipped_reads(model)
    assert "as fp32, for their blocks differ from their values: down of layer 17" in status
    assert "not read" not in status and "read as fp32" in caplog.text
    assert not model.layers[17]["down"].kinds and model.layers[16]["down"].kinds == ["Q4_1"]
    assert torch.equal(model.layers[17]["down"].unpack(), quant.dequantize(layouts.blocks("Q4_1", original, 576)))
    prompt = [[1, 2, 3, 4]]
    plain = LLM(enable_prefix_cache=False)
    assert llm.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids


@needs_kernels
def test_a_tied_lm_head_whose_blocks_differ_is_read_as_fp32_by_the_embedding_too(monkeypatch):
    """The LM head misread (simulated as above): the embedding, which takes its rows from the head's panels, reads
    the fp32 panels too, and the output is the unchanged model's."""
    llm = LLM(enable_prefix_cache=False)
    model = llm.engine.runner.model
    assert model.embed is model.lm_head and model.lm_head.kinds == ["Q8_0"]
    _misread(monkeypatch, model.lm_head.parts[0], (0, 3, 40))  # a weight of token 0..15's rows
    assert "as fp32, for their blocks differ from their values: lm_head" in probe._shipped_reads(model)
    assert model.embed is model.lm_head and not model.lm_head.kinds
    prompt = [[1, 2, 3, 4, 15]]
    plain = LLM(enable_prefix_cache=False)
    assert llm.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids


@needs_kernels
def test_the_shipped_check_runs_again_for_other_weights_bytes_or_another_library(monkeypatch, tmp_path):
    """The start-up check of the weights read as shipped runs once for a file's bytes and a library: its verdict is
    kept for the next start, but a weight's bytes changed by a bit (another file) or a library rebuilt from the same
    sources (another compiler, other flags) is checked again."""
    model = LLM(enable_prefix_cache=False).engine.runner.model
    monkeypatch.setenv("PREFIXCACHE_HOME", str(tmp_path))
    checks = []
    monkeypatch.setattr(kernel_check, "shipped", lambda m, gen: checks.append(m) or ["down of layer 17"])
    assert probe._shipped_verdict(model) == probe._shipped_verdict(model) == ["down of layer 17"]
    assert len(checks) == 1
    data = model.layers[16]["down"].parts[0].data
    data[3, 5, 100] ^= 1
    assert probe._shipped_verdict(model) == ["down of layer 17"] and len(checks) == 2
    data[3, 5, 100] ^= 1
    real = kernels.loaded()
    monkeypatch.setattr(kernels, "loaded", lambda: dataclasses.replace(real, sha256="0" * 64))
    assert probe._shipped_verdict(model) == ["down of layer 17"] and len(checks) == 3
    monkeypatch.setattr(kernels, "loaded", lambda: real)
    probe._shipped_verdict(model)
    assert len(checks) == 3

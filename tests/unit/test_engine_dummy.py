"""Named shapes for ``load_format="dummy"``: the shipped configs build the published parameter
counts (on the meta device: no memory), and a small shape serves requests with random weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.models.model_loader import build_model
from engine.sampling_params import SamplingParams

# published sizes (parameters, tied embeddings counted once)
SIZES = {"llama-3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
         "mistral-7b": 7_248_023_552, "smollm2-135m": 134_515_008}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_named_shape_parameter_count(name):
    cfg = ModelConfig.named(name)
    m = build_model(cfg, torch.bfloat16, torch.device("meta"))
    assert sum(p.numel() for p in m.parameters()) == SIZES[name]
    assert (cfg.arch, cfg.qk_norm, cfg.attention_bias) == {
        "llama-3.1-8b": ("llama", False, False), "qwen2.5-7b": ("qwen2", False, True),
        "qwen3-8b": ("qwen3", True, False), "mistral-7b": ("mistral", False, False),
        "smollm2-135m": ("llama", False, False)}[name]
    if name == "llama-3.1-8b":
        assert cfg.rope_scaling["rope_type"] == "llama3"


def test_dummy_engine_serves_token_ids():
    eng = Engine("smollm2-135m", load_format="dummy", page_size=4, num_pages=64, max_running_requests=2,
                 max_context=128)
    assert eng.tokenizer is None
    a = eng.generate([[1, 2, 3, 4, 5], [7] * 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    b = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in a] == [4, 4] and a[0].token_ids == b[0].token_ids
    with pytest.raises(InvalidRequestError, match="prompt"):
        eng.add_request("text needs a tokenizer")
    eng.check_invariants(expect_idle=True)

"""P on GPU 0 and D on GPU 1 (both on GPU 0 on a one-GPU machine) give the co-located engine's tokens:
real processes, the real transfer engine over UCX CUDA transports (cuda_ipc), flashinfer + CUDA
graphs on both sides, a second request that reuses D's cached prefix so only the delta moves.
Skipped without CUDA (and without the libucx package the transfer engine binds).
"""

from __future__ import annotations

import json
import types

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_pd_on_gpus_equals_colocated(tmp_path):
    pytest.importorskip("libucx")
    from bench.gpu_transfer import pd
    from engine.config import CONFIGS_DIR

    cfg = json.loads((CONFIGS_DIR / "llama-3.1-8b.json").read_text())
    cfg.update(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=1000, num_hidden_layers=2)  # head_dim 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    res = pd(types.SimpleNamespace(pd_tokens=8, transports=None, model=str(tmp_path)))
    assert res["all_equal"], res
    r0, r1 = res["requests"]
    assert (r0["pre_len_on_D"], r0["pages_sent"]) == (0, 63)  # ceil(1000 / 16)
    assert (r1["pre_len_on_D"], r1["pages_sent"]) == (512, 19)  # ceil(812 / 16) - 512 / 16: the delta only
    assert len(r0["pd_tokens"]) == 8

"""Our Llama-family model vs transformers on tiny random checkpoints of each architecture switch:
Qwen2 (qkv bias), Qwen3 (qk-norm), Llama 3 (llama3 RoPE scaling), Mistral. Logits of every
position of a prefill split into a cached prefix + an extend, and of decode steps, must match.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)

CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, use_sliding_window=False)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "smollm-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# (fused_ops, cpu_linear, attention_backend): the reference path, the CPU default (fused q/k/v and
# gate/up with packed weights, the C++ paged decode kernel) and its fallback without the kernel
PATHS = {"reference": (False, "torch", "torch"), "cpu-default": (True, "packed", "cpu_paged"),
         "cpu-paged-gather": (True, "packed", "torch_paged")}


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_arch_matches_transformers(name, device, path, tmp_path):
    cfg_cls, model_cls, extra = CASES[name]
    fused, cpu_linear, backend = PATHS[path]
    if device != "cpu" and backend == "cpu_paged":
        pytest.skip("cpu_paged is the CPU kernel; the GPU runs the other paths")
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    ref = getattr(transformers, model_cls)(cfg).eval()
    if name == "qwen2":  # random init leaves biases at 0; make them matter
        with torch.no_grad():
            for layer in ref.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):  # HF names
                    p.bias.normal_(0, 0.5)
    if name == "qwen3":
        with torch.no_grad():
            for layer in ref.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path)
    ref = ref.to(device)
    runner = ModelRunner(EngineConfig(model=str(tmp_path), page_size=4, num_pages=64, device=device,
                                      attention_backend=backend, fused_ops=fused, cpu_linear=cpu_linear,
                                      max_running_requests=2, max_context=128))
    assert runner.model_config.arch == {"llama3": "llama", "smollm-tied": "llama"}.get(name, name)
    ids = torch.randint(0, 97, (70,)).tolist()  # positions past original_max_position_embeddings
    with torch.no_grad():
        want = ref(torch.tensor([ids], device=device)).logits[0]
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc_slots(0, 69, None)
    assert slots.device.type == device
    runner.req_to_token_pool.write(row, 0, slots)
    pre = 24
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids[:pre]], slots[:pre], device))
    got = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [pre], [ids[pre:69]], slots[pre:], device),
                         logit_index=torch.arange(69 - pre))
    torch.testing.assert_close(got, want[pre:69], atol=1e-4, rtol=0)
    last = runner.allocator.alloc_slots(69, 70, int(slots[-1]))
    runner.req_to_token_pool.write(row, 69, last)
    got = runner.forward(ForwardBatch.build(ForwardMode.DECODE, [row], [69], [[ids[69]]], last, device))
    torch.testing.assert_close(got[0], want[69], atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_engine_on_gpu_matches_cpu(tmp_path):
    """The co-located engine (scheduler, torch backend, sampler) on CUDA gives the CPU's greedy tokens."""
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**BASE, "head_dim": 16})).save_pretrained(tmp_path)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (1, 4, 9, 33)]
    outs = {}
    for dev in ("cpu", "cuda"):
        eng = Engine(str(tmp_path), device=dev, attention_backend="torch", page_size=4, num_pages=64,
                     max_running_requests=4, max_context=128)
        outs[dev] = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True))]
        seeded = eng.generate(prompts[1], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
        assert len(seeded[0].token_ids) == 6
        eng.check_invariants(expect_idle=True)
    assert outs["cuda"] == outs["cpu"]

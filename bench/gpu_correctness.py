"""Correctness section of the GPU benchmark: our model vs transformers with the same random weights
(shapes of Llama-3.1-8B and Qwen2.5-7B cut to the first N layers; logits rel. error in bf16 with
flashinfer + fused ops + CUDA graphs, and in fp32 with the torch backend), and flashinfer vs torch
attention on one extend-with-prefix batch, one extend batch without prefixes and one decode batch."""

from __future__ import annotations

import json
import os

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _hf_model(shape: str, layers: int, dtype, device, overrides: dict | None = None):
    """(HF config, config dict, random HF model) of a shipped shape cut to ``layers`` layers."""
    import transformers

    from engine.config import CONFIGS_DIR

    d = json.loads((CONFIGS_DIR / f"{shape}.json").read_text())
    d["num_hidden_layers"] = layers
    d.pop("torch_dtype", None)
    if "rope_scaling" in d:  # transformers 5 spells it rope_parameters
        d["rope_parameters"] = {**d.pop("rope_scaling"), "rope_theta": d.pop("rope_theta")}
    d.update(overrides or {})
    cls = getattr(transformers, d["architectures"][0])
    cfg = transformers.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device(device):
        ref = cls(cfg).to(dtype).eval()
    with torch.no_grad():  # make biases and norms matter
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return cfg, d, ref


def model_vs_transformers(shape: str, layers: int, dtype_name: str, tmpdir: str, prompt_len: int = 300,
                          decode_steps: int = 4, device: str = "cuda", overrides: dict | None = None) -> dict:
    """Save a random HF checkpoint, load it with our engine on CUDA, compare logits of a prefill split
    into prefix + extend and of decode steps. bf16 uses auto (flashinfer + fused + graphs); fp32 torch."""
    from engine.config import EngineConfig
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.model_runner import ModelRunner

    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    import copy

    cfg, d, ref = _hf_model(shape, layers, torch.float32, device, overrides)
    path = os.path.join(tmpdir, f"{shape}-{layers}")
    ref.save_pretrained(path)
    refs = {"fp32": ref}
    if dtype is torch.bfloat16:
        refs["bf16"] = copy.deepcopy(ref).to(torch.bfloat16)
    runner = ModelRunner(EngineConfig(model=path, dtype=dtype, device=device, page_size=16, num_pages=256,
                                      max_running_requests=4, max_context=1024, cuda_graph_max_bs=4))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (prompt_len + decode_steps,), generator=g).tolist()
    with torch.no_grad():
        want = {k: m(torch.tensor([ids], device=device)).logits[0].float() for k, m in refs.items()}
    n = prompt_len
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc_slots(0, n + decode_steps, None)
    runner.req_to_token_pool.write(row, 0, slots)
    pre = 128
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids[:pre]], slots[:pre], device))
    got = [runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [pre], [ids[pre:n]], slots[pre:n], device),
                          logit_index=torch.arange(n - pre, device=device))]
    for t in range(n, n + decode_steps):
        got.append(runner.forward(ForwardBatch.build(ForwardMode.DECODE, [row], [t], [[ids[t]]], slots[t:t + 1],
                                                     device)).clone())
    got = torch.cat(got, 0).float()
    out = {"shape": shape, "layers": layers, "dtype": dtype_name, "backend": type(runner.backend).__name__,
           "cuda_graph": runner.graph_runner is not None, "fused_ops": runner.model._fused is not None,
           "small_m_gemm_calls": getattr(runner.model._fused, "small_m_calls", 0),
           "tuned_gemm_calls": getattr(getattr(runner.model._fused, "tuned", None), "calls", 0),
           "positions": [pre, n + decode_steps]}
    for k, w in want.items():
        out[f"rel_err_vs_hf_{k}"] = _rel(got, w[pre:n + decode_steps])
        out[f"argmax_agree_vs_hf_{k}"] = float((got.argmax(-1) == w[pre:n + decode_steps].argmax(-1)).float().mean())
    if "bf16" in want:
        out["hf_bf16_vs_hf_fp32_rel_err"] = _rel(want["bf16"][pre:], want["fp32"][pre:])
    del runner, refs, ref
    torch.cuda.empty_cache()
    return out


def backend_vs_torch(page_size: int = 16, seed: int = 0, extend_mode: str = "ragged",
                     layout: str = "page_major", prefill_backend: str | None = None) -> dict:
    """flashinfer vs torch attention on the same pool: an extend batch over cached prefixes (one
    request without a prefix, unaligned prefixes), an extend batch with no prefix at all, and a decode
    batch (Llama-3.1-8B heads, bf16); ``prefill_backend``: the paged prefill kernels (default: the
    backend's). Returns rel. errors."""
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.kvcache.kv_pool import KVPool
    from engine.kvcache.page_allocator import PageAllocator
    from engine.kvcache.req_to_token_pool import ReqToTokenPool

    H, KVH, D, dev, dt = 32, 8, 128, "cuda", torch.bfloat16
    torch.manual_seed(seed)
    pool = KVPool(512, page_size, 2, KVH, D, dt, dev, layout=layout)  # 2 layers: page_major is strided
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    alloc = PageAllocator(512, page_size, dev)
    r2t = ReqToTokenPool(8, 2048, dev)
    fi = FlashInferAttentionBackend(pool, r2t, H, KVH, D, extend_mode=extend_mode, prefill_backend=prefill_backend)
    tb = TorchAttentionBackend(pool, r2t, H, KVH, D)
    # pages handed out in a shuffled order so page tables are not the identity
    alloc._free = [int(p) for p in torch.randperm(512)]
    pres, exts = [0, 37, 160, 511], [50, 1, 77, 300]
    rows, locs = [], []
    for pre, ext in zip(pres, exts):
        row = r2t.alloc()
        slots = alloc.alloc_slots(0, pre + ext + 1, None)
        r2t.write(row, 0, slots)
        rows.append(row)
        locs.append(slots)

    def rel_err(batch, q, k, v) -> float:
        """Layer 0's attention output of flashinfer vs torch on ``batch``."""
        fi.init_forward(batch)
        o_fi = fi.forward(q, k, v, 0, batch)
        tb.init_forward(batch)
        return _rel(o_fi, tb.forward(q, k, v, 0, batch))

    out = {}
    T = sum(exts)
    q = torch.randn(T, H, D, dtype=dt, device=dev)
    k = torch.randn(T, KVH, D, dtype=dt, device=dev)
    v = torch.randn(T, KVH, D, dtype=dt, device=dev)
    b = ForwardBatch.build(ForwardMode.EXTEND, rows, pres, [[0] * e for e in exts],
                           torch.cat([s[p:p + e] for s, p, e in zip(locs, pres, exts)]), dev)
    out["extend_rel_err"] = rel_err(b, q, k, v)
    b0 = ForwardBatch.build(ForwardMode.EXTEND, rows, [0] * 4, [[0] * e for e in exts],
                            torch.cat([s[:e] for s, e in zip(locs, exts)]), dev)
    out["extend_no_prefix_rel_err"] = rel_err(b0, q, k, v)
    seq = [p + e for p, e in zip(pres, exts)]
    qd = torch.randn(4, H, D, dtype=dt, device=dev)
    kd = torch.randn(4, KVH, D, dtype=dt, device=dev)
    vd = torch.randn(4, KVH, D, dtype=dt, device=dev)
    bd = ForwardBatch.build(ForwardMode.DECODE, rows, seq, [[0]] * 4, torch.stack([s[n] for s, n in zip(locs, seq)]),
                            dev)
    out["decode_rel_err"] = rel_err(bd, qd, kd, vd)
    return out


def correctness(args) -> dict:
    import tempfile

    res = {"backend_vs_torch": backend_vs_torch(),
           "backend_vs_torch_paged_extend": backend_vs_torch(extend_mode="paged"),
           "backend_vs_torch_layer_major": backend_vs_torch(layout="layer_major")}
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for shape in ("llama-3.1-8b", "qwen2.5-7b"):
            for dt in ("bf16", "fp32"):
                runs.append(model_vs_transformers(shape, args.ref_layers, dt, tmp))
                print(json.dumps(runs[-1]), flush=True)
        res["model_vs_transformers"] = runs
    return res

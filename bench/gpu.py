"""GPU benchmark and checks against the H200's limits (not a test; results JSON + a table).

    python -m bench.gpu ceilings correctness decode prefill [--out bench/results/gpu_h200.json]
    python -m bench.gpu transfer pd --out ...          (two GPUs: KV transfer GPU0 -> GPU1, P/D)

Sections (each adds one key to the JSON):
  ceilings     device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 GEMM rate:
               the two ceilings every floor below divides by
  correctness  our model vs transformers with the same random weights (shapes of Llama-3.1-8B and
               Qwen2.5-7B, first N layers): logits rel. error in bf16 (flashinfer + fused ops + CUDA
               graphs) and fp32 (torch backend); flashinfer vs torch attention on one extend-with-
               prefix batch and one decode batch
  decode       8B dummy weights, batch x context grid: median step time (graph replay incl. plan and
               input copies; and the whole step with device argmax + .tolist()) vs the floor
               (weight bytes + KV bytes read) / copy bandwidth; eager (no graph) at a few points
  prefill      one 8192-token prompt (and 4 x 2048-token chunks over the cached prefix) vs the floor
               FLOPs / GEMM rate; FLOPs = 2 * tokens * linear params + 2 * T^2 * head_dim * heads *
               layers (causal attention, QK^T and PV)
  transfer     see bench/gpu_transfer.py
  pd           see bench/gpu_transfer.py

Floors are written before the run into bench/results/GPU_NOTES.md; this prints measured / floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

COPY_BW_DEFAULT = 4.26e12  # B/s, KINDS.md (bytes read + written)
GEMM_DEFAULT = 788e12  # FLOP/s, KINDS.md


def _events_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


# ----------------------------------------------------------------------------- ceilings
def ceilings(args) -> dict:
    n = 1 << 30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = statistics.median(_events_ms(lambda: b.copy_(a), 20))
    copy_bw = 2 * n / (ms / 1e3)
    del a, b
    N = 8192
    x = torch.randn(N, N, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(N, N, dtype=torch.bfloat16, device="cuda")
    ms_g = statistics.median(_events_ms(lambda: x @ y, 10))
    gemm = 2 * N**3 / (ms_g / 1e3)
    return {"copy_bytes": n, "copy_ms": ms, "copy_bw_Bps": copy_bw, "gemm_ms": ms_g, "gemm_flops": gemm,
            "device": torch.cuda.get_device_name()}


# ----------------------------------------------------------------------------- correctness
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
                     layout: str = "page_major") -> dict:
    """flashinfer vs torch attention on the same pool: an extend batch over cached prefixes (one
    request without a prefix, unaligned prefixes), an extend batch with no prefix at all, and a decode
    batch (Llama-3.1-8B heads, bf16). Returns rel. errors."""
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
    fi = FlashInferAttentionBackend(pool, r2t, H, KVH, D, extend_mode=extend_mode)
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
    out = {}
    T = sum(exts)
    q = torch.randn(T, H, D, dtype=dt, device=dev)
    k = torch.randn(T, KVH, D, dtype=dt, device=dev)
    v = torch.randn(T, KVH, D, dtype=dt, device=dev)
    b = ForwardBatch.build(ForwardMode.EXTEND, rows, pres, [[0] * e for e in exts],
                           torch.cat([s[p:p + e] for s, p, e in zip(locs, pres, exts)]), dev)
    fi.init_forward(b)
    o_fi = fi.forward(q, k, v, 0, b)
    tb.init_forward(b)
    o_t = tb.forward(q, k, v, 0, b)
    out["extend_rel_err"] = _rel(o_fi, o_t)
    b0 = ForwardBatch.build(ForwardMode.EXTEND, rows, [0] * 4, [[0] * e for e in exts],
                            torch.cat([s[:e] for s, e in zip(locs, exts)]), dev)
    fi.init_forward(b0)
    o_fi = fi.forward(q, k, v, 0, b0)
    tb.init_forward(b0)
    o_t = tb.forward(q, k, v, 0, b0)
    out["extend_no_prefix_rel_err"] = _rel(o_fi, o_t)
    seq = [p + e for p, e in zip(pres, exts)]
    qd = torch.randn(4, H, D, dtype=dt, device=dev)
    kd = torch.randn(4, KVH, D, dtype=dt, device=dev)
    vd = torch.randn(4, KVH, D, dtype=dt, device=dev)
    bd = ForwardBatch.build(ForwardMode.DECODE, rows, seq, [[0]] * 4, torch.stack([s[n] for s, n in zip(locs, seq)]),
                            dev)
    fi.init_forward(bd)
    o_fi = fi.forward(qd, kd, vd, 0, bd)
    tb.init_forward(bd)
    o_t = tb.forward(qd, kd, vd, 0, bd)
    out["decode_rel_err"] = _rel(o_fi, o_t)
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


# ----------------------------------------------------------------------------- 8B runner
def _runner(args, max_bs: int, max_context: int, num_pages: int, cuda_graph: bool = True):
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    t = time.perf_counter()
    r = ModelRunner(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                                 page_size=16, num_pages=num_pages, max_running_requests=max_bs,
                                 max_context=max_context, cuda_graph=cuda_graph, cuda_graph_max_bs=max_bs,
                                 chunked_prefill_size=1 << 20))
    torch.cuda.synchronize()
    return r, time.perf_counter() - t


def _weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads: every parameter but the embedding table, embedding bytes)."""
    emb = model.model.embed_tokens.weight
    # fused projections: the q/k/v / gate/up params are views into one tensor each; count each view once
    tot = 0
    seen_st = set()
    for name, p in model.named_parameters():
        if p is emb:
            continue
        st = p.untyped_storage().data_ptr()
        key = (st, p.storage_offset())
        if key in seen_st:
            continue
        seen_st.add(key)
        tot += p.numel() * p.element_size()
    return tot, emb.numel() * emb.element_size()


def decode(args) -> dict:
    from engine.forward_batch import ForwardBatch, ForwardMode

    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    maxB, maxC = max(batches), max(contexts)
    ps = 16
    pages_per_req = -(-(maxC + 1) // ps)
    num_pages = maxB * pages_per_req + 8
    runner, load_s = _runner(args, maxB, maxC + ps, num_pages)
    mc = runner.model_config
    kv_tok = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2  # bytes per token (bf16 K+V)
    for buf in runner.kv_pool.buffers():  # random K/V (never time on zeros)
        buf.normal_()
    wbytes, ebytes = _weight_bytes(runner.model)
    bw = args.copy_bw
    rows = [runner.req_to_token_pool.alloc() for _ in range(maxB)]
    slots = [runner.allocator.alloc_slots(0, maxC + 1, None) for _ in range(maxB)]
    for r, s in zip(rows, slots):
        runner.req_to_token_pool.write(r, 0, s)
    results = []
    g = torch.Generator().manual_seed(0)
    for C in contexts:
        for B in batches:
            ids = torch.randint(0, mc.vocab_size, (B,), generator=g).tolist()
            batch = ForwardBatch.build(ForwardMode.DECODE, rows[:B], [C] * B, [[t] for t in ids],
                                       torch.stack([s[C] for s in slots[:B]]), "cuda")
            fwd = lambda: runner.forward(batch)  # noqa: E731
            ms_graph = statistics.median(_events_ms(fwd, args.iters))
            gr = runner.graph_runner
            replay = gr.graphs[gr.bucket_for(B)].replay
            ms_replay = statistics.median(_events_ms(replay, args.iters))

            def step():
                runner.forward(batch).argmax(-1).tolist()

            for _ in range(3):
                step()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            ms_step = (time.perf_counter() - t0) / args.iters * 1e3
            # host time of one step's launch (input copies + plan + replay launch), GPU idle meanwhile
            host = []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.forward(batch)
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            ms_host = statistics.median(host)
            # steps queued back to back with no per-step sync: the step time of a scheduler that
            # prepares step n+1 while the GPU runs step n (sglang's overlap scheduler); ours syncs
            t0 = time.perf_counter()
            for _ in range(args.iters):
                runner.forward(batch)
            torch.cuda.synchronize()
            ms_pipelined = (time.perf_counter() - t0) / args.iters * 1e3
            kv_read = B * C * kv_tok
            floor_bytes = wbytes + kv_read + B * ebytes // mc.vocab_size
            floor_ms = floor_bytes / bw * 1e3
            row = {"batch": B, "context": C, "graph_ms": ms_graph, "replay_ms": ms_replay, "step_ms": ms_step,
                   "floor_ms": floor_ms, "frac_of_floor_replay": floor_ms / ms_replay,
                   "weight_bytes": wbytes, "kv_bytes": kv_read, "frac_of_floor_graph": floor_ms / ms_graph,
                   "frac_of_floor_step": floor_ms / ms_step, "host_ms": ms_host, "pipelined_ms": ms_pipelined,
                   "frac_of_floor_pipelined": floor_ms / ms_pipelined,
                   "achieved_TBps_graph": floor_bytes / (ms_graph / 1e3) / 1e12}
            if B in args.eager_batches and C == contexts[0]:
                eager = lambda: runner.model(batch, runner.backend)  # noqa: E731
                with torch.inference_mode():
                    row["eager_ms"] = statistics.median(_events_ms(eager, max(5, args.iters // 2)))
            results.append(row)
            print(json.dumps(row), flush=True)
    out = {"model": args.model, "load_s": load_s, "copy_bw_Bps": bw, "kv_bytes_per_token": kv_tok,
           "weight_bytes": wbytes, "buckets": runner.graph_runner.buckets, "rows": results}
    del runner
    torch.cuda.empty_cache()
    return out


def host_profile(args) -> dict:
    """Where the host time of a graph decode step goes (cProfile of ``runner.forward`` at B=1 and
    B=128, context 4096, GPU idle before each call): the time a scheduler that syncs every step
    leaves the GPU idle."""
    import cProfile
    import io
    import pstats

    from engine.forward_batch import ForwardBatch, ForwardMode

    C, ps, maxB = 4096, 16, 128
    runner, _ = _runner(args, maxB, C + ps, maxB * (-(-(C + 1) // ps)) + 8)
    rows = [runner.req_to_token_pool.alloc() for _ in range(maxB)]
    slots = [runner.allocator.alloc_slots(0, C + 1, None) for _ in range(maxB)]
    for r, sl in zip(rows, slots):
        runner.req_to_token_pool.write(r, 0, sl)
    out = {}
    for B in (1, maxB):
        batch = ForwardBatch.build(ForwardMode.DECODE, rows[:B], [C] * B, [[1]] * B,
                                   torch.stack([sl[C] for sl in slots[:B]]), "cuda")
        for _ in range(3):
            runner.forward(batch)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        n = 30
        for _ in range(n):
            torch.cuda.synchronize()
            prof.enable()
            runner.forward(batch)
            prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf).sort_stats("tottime")
        st.print_stats(18)
        text = buf.getvalue()
        print(f"host profile B={B} ctx={C} ({n} steps):\n{text}", flush=True)
        out[str(B)] = {"steps": n, "total_s": st.total_tt, "per_step_ms": st.total_tt / n * 1e3,
                       "top": text[-6000:]}
    del runner
    torch.cuda.empty_cache()
    return out


def attn_micro(args) -> dict:
    """flashinfer paged decode alone (one layer, Llama-8B heads, bf16, page 16): KV bytes read / time,
    CUDA-core vs tensor-core kernels; pages shuffled."""
    import flashinfer

    H, KVH, D, ps = 32, 8, 128, 16
    res = []
    for B, C in ((64, 2048), (128, 1024), (128, 4096), (1, 4096)):
        P = B * C // ps
        k = torch.randn(P, ps, KVH, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        indptr = torch.arange(0, P + 1, C // ps, dtype=torch.int32)
        idx = torch.randperm(P, device="cuda").to(torch.int32)
        last = torch.full((B,), ps, dtype=torch.int32)
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        for tc in (False, True):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(indptr, idx, last, H, KVH, D, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            ms = statistics.median(_events_ms(lambda: w.run(q, (k, v)), 20))
            byts = 2 * B * C * KVH * D * 2
            res.append({"batch": B, "context": C, "tensor_cores": tc, "ms": ms, "TBps": byts / ms / 1e9})
            print(res[-1], flush=True)
        del k, v
        torch.cuda.empty_cache()
    return {"rows": res}


def profile(args) -> dict:
    """Per-kernel GPU time of one eager decode step (torch.profiler), grouped by kernel name, at a
    few batch sizes (context 1024): which kernels keep a step from the floor."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from engine.forward_batch import ForwardBatch, ForwardMode

    batches = [1, 128]
    C, ps = 1024, 16
    runner, _ = _runner(args, max(batches), C + ps, max(batches) * (C // ps + 2) + 8)
    for buf in runner.kv_pool.buffers():
        buf.normal_()
    mc = runner.model_config
    out = {}
    for B in batches:
        rows, locs = [], []
        for _ in range(B):
            row = runner.req_to_token_pool.alloc()
            s = runner.allocator.alloc_slots(0, C + 1, None)
            runner.req_to_token_pool.write(row, 0, s)
            rows.append(row)
            locs.append(s[C])
        batch = ForwardBatch.build(ForwardMode.DECODE, rows, [C] * B, [[1]] * B, torch.stack(locs), "cuda")
        with torch.inference_mode():
            for _ in range(3):
                runner.model(batch, runner.backend)
            torch.cuda.synchronize()
            steps = 5
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    runner.model(batch, runner.backend)
                torch.cuda.synchronize()
        agg: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                a = agg.setdefault(ev.name[:90], [0.0, 0])
                a[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
                a[1] += 1
        rows_out = sorted(([k, v[0] / steps / 1e3, v[1] // steps] for k, v in agg.items()), key=lambda r: -r[1])
        total = sum(r[1] for r in rows_out)
        out[str(B)] = {"kernel_ms_per_step": total, "top": rows_out[:14]}
        print(f"profile B={B} ctx={C}: kernel time {total:.3f} ms/step", flush=True)
        for k, ms, n in rows_out[:14]:
            print(f"  {ms:7.3f} ms  x{n:4d}  {k}", flush=True)
        for row in rows:
            runner.req_to_token_pool.free(row)
    del runner
    torch.cuda.empty_cache()
    return out


def prefill(args) -> dict:
    from engine.forward_batch import ForwardBatch, ForwardMode

    T = args.prefill_tokens
    ps = 16
    runner, _ = _runner(args, 4, T + ps, -(-T // ps) + 8, cuda_graph=False)
    mc = runner.model_config
    lin = sum(m.weight.numel() for layer in runner.model.model.layers for m in layer.modules()
              if isinstance(m, torch.nn.Linear))
    attn_flops = 2 * T * T * mc.head_dim * mc.num_heads * mc.num_layers  # causal: half of 4*T^2*D*H*L
    flops = 2 * T * lin + attn_flops + 2 * mc.hidden_size * mc.vocab_size
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc_slots(0, T, None)
    runner.req_to_token_pool.write(row, 0, slots)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.vocab_size, (T,), generator=g).tolist()
    batch = ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids], slots, "cuda")
    chunk = T // 4
    chunks = [ForwardBatch.build(ForwardMode.EXTEND, [row], [i * chunk], [ids[i * chunk:(i + 1) * chunk]],
                                 slots[i * chunk:(i + 1) * chunk], "cuda") for i in range(4)]

    def chunked():
        for c in chunks:
            runner.forward(c)

    by_mode = {}
    default_mode = runner.backend.extend_mode
    for mode in ("paged", default_mode) if default_mode != "paged" else ("paged",):
        runner.backend.extend_mode = mode  # read by init_forward at each batch
        try:
            whole = statistics.median(_events_ms(lambda: runner.forward(batch), args.iters_prefill, warmup=2))
            parts = statistics.median(_events_ms(chunked, args.iters_prefill, warmup=1))
            by_mode[mode] = {"ms": whole, "chunked_4x_ms": parts}
        except Exception as e:  # noqa: BLE001 - a failing kernel path is a result too
            by_mode[mode] = {"error": repr(e)[:300]}
        print(f"prefill extend_mode={mode}: {by_mode[mode]}", flush=True)
    runner.backend.extend_mode = default_mode
    ms, ms_chunked = by_mode[default_mode]["ms"], by_mode[default_mode]["chunked_4x_ms"]
    floor_ms = flops / args.gemm_rate * 1e3
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(batch)
        torch.cuda.synchronize()
    agg: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            agg[ev.name[:90]] = agg.get(ev.name[:90], 0.0) + ev.device_time_total / 1e3
    top = sorted(agg.items(), key=lambda kv: -kv[1])[:12]
    for k, v in top:
        print(f"  prefill kernel {v:8.2f} ms  {k}", flush=True)
    out = {"kernels_top_ms": top, "tokens": T, "flops": flops, "linear_params": lin, "attn_flops": attn_flops, "ms": ms,
           "floor_ms": floor_ms, "frac_of_floor": floor_ms / ms, "achieved_TFLOPs": flops / ms / 1e9,
           "chunked_4x_ms": ms_chunked, "chunked_frac_of_floor": floor_ms / ms_chunked,
           "extend_mode": default_mode, "by_extend_mode": by_mode}
    print(json.dumps(out), flush=True)
    del runner
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sections", nargs="+",
                   choices=["ceilings", "correctness", "decode", "prefill", "profile", "host_profile", "attn_micro", "transfer",
                            "pd"])
    p.add_argument("--out", default="bench/results/gpu_h200.json")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--eager-batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--iters-prefill", type=int, default=5)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--ref-layers", type=int, default=4, help="layers of the shapes compared with transformers")
    p.add_argument("--transfer-reps", type=int, default=5)
    p.add_argument("--transfer-busy-poll", action="store_true",
                   help="the sending engine polls without sleeping while a batch is in flight")
    p.add_argument("--pd-tokens", type=int, default=24, help="tokens generated per P/D request")
    p.add_argument("--transports", default=None, help="UCX_TLS for the transfer engines (default: UCX's choice)")
    p.add_argument("--copy-bw", type=float, default=None, help="B/s (default: measured by ceilings, else 4.26e12)")
    p.add_argument("--gemm-rate", type=float, default=None, help="FLOP/s (default: measured, else 788e12)")
    args = p.parse_args(argv)
    res = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            res = json.load(f)
    res.setdefault("meta", {})["torch"] = torch.__version__
    for sec in args.sections:
        t = time.perf_counter()
        if sec in ("transfer", "pd"):
            from bench import gpu_transfer

            res[sec] = getattr(gpu_transfer, sec)(args)
        else:
            if sec in ("decode", "prefill"):
                c = res.get("ceilings", {})
                args.copy_bw = args.copy_bw or COPY_BW_DEFAULT
                args.gemm_rate = args.gemm_rate or GEMM_DEFAULT
                res.setdefault("meta", {})["floors_use"] = {"copy_bw_Bps": args.copy_bw, "gemm_flops": args.gemm_rate,
                                                            "measured_this_run": c}
            try:
                res[sec] = globals()[sec](args)
            except Exception as e:  # keep the other sections' results
                import traceback

                traceback.print_exc()
                res[sec] = {"error": repr(e)}
        res[sec + "_wall_s"] = time.perf_counter() - t
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    return 0


def table(res: dict) -> str:
    lines = []
    c = res.get("ceilings")
    if c and "copy_bw_Bps" in c:
        lines.append(f"ceilings: copy {c['copy_bw_Bps'] / 1e12:.2f} TB/s, bf16 GEMM {c['gemm_flops'] / 1e12:.0f} TFLOP/s")
    d = res.get("decode")
    if d and "rows" in d:
        lines.append("decode  B   ctx   graph_ms replay_ms step_ms host_ms pipe_ms floor_ms  floor/replay"
                     "  floor/step  floor/pipe  eager_ms")
        for r in d["rows"]:
            lines.append(f"      {r['batch']:4d} {r['context']:5d} {r['graph_ms']:9.3f} {r['replay_ms']:9.3f} "
                         f"{r['step_ms']:7.3f} {r.get('host_ms', float('nan')):7.3f} "
                         f"{r.get('pipelined_ms', float('nan')):7.3f} {r['floor_ms']:8.3f} "
                         f"{r['frac_of_floor_replay']:12.1%} {r['frac_of_floor_step']:11.1%} "
                         f"{r.get('frac_of_floor_pipelined', float('nan')):11.1%}  {r.get('eager_ms', float('nan')):8.3f}")
    pf = res.get("prefill")
    if pf and "ms" in pf:
        lines.append(f"prefill {pf['tokens']} tok: {pf['ms']:.1f} ms, floor {pf['floor_ms']:.1f} ms "
                     f"({pf['frac_of_floor']:.1%}, {pf['achieved_TFLOPs']:.0f} TFLOP/s); 4 chunks "
                     f"{pf['chunked_4x_ms']:.1f} ms ({pf['chunked_frac_of_floor']:.1%})")
    cr = res.get("correctness")
    if cr and "backend_vs_torch" in cr:
        lines.append(f"flashinfer vs torch: {cr['backend_vs_torch']}")
        for r in cr.get("model_vs_transformers", []):
            errs = {k: round(v, 6) for k, v in r.items() if k.startswith(("rel_err", "hf_"))}
            lines.append(f"  {r['shape']} x{r['layers']} {r['dtype']} {r['backend']} graph={r['cuda_graph']}: {errs}")
    for key in ("transfer", "pd"):
        if key in res:
            lines.append(f"{key}: {json.dumps(res[key])[:1500]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

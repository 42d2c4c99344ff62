"""``prefill_parts`` section of the GPU benchmark: where an 8k-token prefill pass loses time against
its FLOP floor, beyond the per-kernel totals the ``prefill`` section prints.

* timeline: one eager pass under torch.profiler: the span from the pass's first kernel to its last,
  the kernels' busy time inside it (the union of their intervals), the host time from the call to
  the first kernel, and the longest idle gaps with the kernels around each;
* ops: the layer-0 ops the fused path changed, alone at the pass's shape: RoPE + the K/V store as
  flashinfer RoPE + ``KVPool.write`` vs the one-kernel ``rope_kv_store``, and the ragged attention
  on strided q/k/v views vs on contiguous copies (plus the copies' own time);
* ab: the whole pass with ``rope_kv_store`` on and off (``FusedOps.rope_store``), interleaved.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench.gpu_runner import PAGE_SIZE, build_runner, prefill_row
from bench.gpu_timing import events_ms, kernel_intervals


def _timeline(prof, t_call_us: float) -> dict:
    """Busy/idle split of the profiled pass (see the module docstring); ``t_call_us``: the host
    timestamp (profiler clock) of the forward call."""
    ks = kernel_intervals(prof)
    busy, gaps = 0.0, []
    cur_s, cur_e, last = ks[0]
    for s, e, name in ks[1:]:  # merge overlapping intervals; a hole between merged runs is a gap
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, last, name))
            cur_s, cur_e, last = s, e, name
        elif e > cur_e:
            cur_e, last = e, name
    busy += cur_e - cur_s
    gaps.sort(key=lambda g: -g[0])
    return {"first_kernels_ms": [[round((s - t_call_us) / 1e3, 3), n] for s, _, n in ks[:3]],
            "last_kernel_end_ms": (max(e for _, e, _ in ks) - t_call_us) / 1e3, "kernels": len(ks), "span_ms": (ks[-1][1] - ks[0][0]) / 1e3, "busy_ms": busy / 1e3,
            "idle_ms": sum(g[0] for g in gaps) / 1e3, "call_to_first_kernel_ms": (ks[0][0] - t_call_us) / 1e3,
            "top_gaps_us": [[round(g, 1), a, b] for g, a, b in gaps[:10]]}


def prefill_parts(args) -> dict:
    """See the module docstring."""
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as tprofile

    from engine.kvcache.rope_kv_store import rope_kv_store

    T, ps = args.prefill_tokens, PAGE_SIZE
    runner, _ = build_runner(args, 4, T + ps, -(-T // ps) + 8, cuda_graph=False)
    mc, fused, be, pool = runner.model_config, runner.model._fused, runner.backend, runner.kv_pool
    batch = prefill_row(runner, T)[3]
    out: dict = {"tokens": T, "rope_store_default": fused.rope_store}

    for _ in range(2):
        runner.forward(batch)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("halfmoon.forward"):
            runner.forward(batch)
        torch.cuda.synchronize()
    t_call = min(ev.time_range.start for ev in prof.events() if ev.name == "halfmoon.forward")
    out["timeline"] = _timeline(prof, t_call)
    out["timeline"]["event_ms"] = statistics.median(events_ms(lambda: runner.forward(batch), 5, warmup=1))
    host = []
    for _ in range(3):  # host time to launch the whole pass, the device idle at the call
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.forward(batch)
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    out["timeline"]["host_launch_ms"] = statistics.median(host)
    gpu_pass = []
    for _ in range(3):  # one pass after 1 s idle: the clock a single pass gets vs back-to-back passes
        time.sleep(1.0)
        gpu_pass.append(events_ms(lambda: runner.forward(batch), 1, warmup=0)[0])
    out["timeline"]["after_idle_event_ms"] = gpu_pass
    print(f"prefill_parts timeline: {out['timeline']}", flush=True)

    # layer-0 ops at the pass's shape
    H, KVH, D = mc.num_heads, mc.num_kv_heads, mc.head_dim
    qkv0 = torch.randn(T, (H + 2 * KVH) * D, device="cuda", dtype=torch.bfloat16)
    qkv = qkv0.clone()
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], -1)
    loc, pos = batch.out_cache_loc, batch.positions
    be.init_forward(batch)

    def old_rope_store():
        fused.rope_(pos, q, k)
        pool.write(0, loc, k.view(T, KVH, D), v.view(T, KVH, D))

    def new_rope_store():
        rope_kv_store(q, k, v, pos, fused.cos_sin_cache, loc, pool.k_pages(0), pool.v_pages(0))

    ops = {}
    for name, fn in (("rope_then_kvpool_write", old_rope_store), ("rope_kv_store", new_rope_store)):
        ops[name + "_ms"] = statistics.median(events_ms(fn, args.iters, warmup=3))
    qs, ks_, vs = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
    copies = lambda: (qs.contiguous(), ks_.contiguous(), vs.contiguous())  # noqa: E731
    for nw in (2, 8):
        ops[f"rope_kv_store_warps{nw}_ms"] = statistics.median(events_ms(
            lambda: rope_kv_store(q, k, v, pos, fused.cos_sin_cache, loc, pool.k_pages(0), pool.v_pages(0),
                                  num_warps=nw), args.iters, warmup=3))
    for n in (1, 32, 128):  # decode batch sizes: the same ops on the first n tokens
        qn, kn, vn, pn, ln = q[:n], k[:n], v[:n], pos[:n], loc[:n]
        ops[f"T{n}_rope_then_kvpool_write_ms"] = statistics.median(events_ms(
            lambda: (fused.rope_(pn, qn, kn), pool.write(0, ln, kn.view(n, KVH, D), vn.view(n, KVH, D))),
            args.iters, warmup=3))
        ops[f"T{n}_rope_kv_store_ms"] = statistics.median(events_ms(
            lambda: rope_kv_store(qn, kn, vn, pn, fused.cos_sin_cache, ln, pool.k_pages(0), pool.v_pages(0)),
            args.iters, warmup=3))
    ops["qkv_copies_ms"] = statistics.median(events_ms(copies, args.iters, warmup=3))
    qc, kc, vc = copies()
    ops["ragged_strided_ms"] = statistics.median(events_ms(lambda: be.ragged_wrapper.run(qs, ks_, vs), args.iters))
    ops["ragged_contiguous_ms"] = statistics.median(events_ms(lambda: be.ragged_wrapper.run(qc, kc, vc), args.iters))
    a, b = be.ragged_wrapper.run(qs, ks_, vs).float(), be.ragged_wrapper.run(qc, kc, vc).float()
    ops["ragged_strided_vs_contiguous_max_abs"] = float((a - b).abs().max())
    out["ops"] = ops
    print(f"prefill_parts ops: {ops}", flush=True)

    ab: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(2):
        for mode in ("on", "off"):
            fused.rope_store = mode == "on"
            ab[mode].append(statistics.median(events_ms(lambda: runner.forward(batch), args.iters_prefill, warmup=1)))
    fused.rope_store = out["rope_store_default"]
    out["ab_rope_store_ms"] = ab
    print(f"prefill_parts A/B rope_kv_store on/off (ms, 2 runs each): {ab}", flush=True)
    del runner
    torch.cuda.empty_cache()
    return out

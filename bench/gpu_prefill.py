"""Prefill section of the GPU benchmark: one 8192-token prompt (and 4 x 2048-token chunks over the
cached prefix) vs the floor FLOPs / GEMM rate, per flashinfer extend mode and per kernel set of the
paged prefill wrapper (``--prefill-backends``, e.g. fa2,fa3); FLOPs = 2 * tokens *
linear params + 2 * T^2 * head_dim * heads * layers (causal attention, QK^T and PV) + the LM
head of the last token."""

from __future__ import annotations

import json
import statistics

import torch

from bench.gpu_runner import PAGE_SIZE, build_runner, prefill_row
from bench.gpu_timing import events_ms, kernel_times


def prefill(args) -> dict:
    """Prefill time, whole and in 4 chunks, against the FLOP floor (see the module docstring)."""
    from engine.forward_batch import ForwardBatch, ForwardMode

    T = args.prefill_tokens
    ps = PAGE_SIZE
    runner, _ = build_runner(args, 4, T + ps, -(-T // ps) + 8, cuda_graph=False)
    mc = runner.model_config
    lin = sum(m.weight.numel() for layer in runner.model.model.layers for m in layer.modules()
              if isinstance(m, torch.nn.Linear))
    attn_flops = 2 * T * T * mc.head_dim * mc.num_heads * mc.num_layers  # causal: half of 4*T^2*D*H*L
    flops = 2 * T * lin + attn_flops + 2 * mc.hidden_size * mc.vocab_size
    row, ids, slots, batch = prefill_row(runner, T)
    chunk = T // 4
    chunks = [ForwardBatch.build(ForwardMode.EXTEND, [row], [i * chunk], [ids[i * chunk:(i + 1) * chunk]],
                                 slots[i * chunk:(i + 1) * chunk], "cuda") for i in range(4)]

    def chunked():
        for c in chunks:
            runner.forward(c)

    def timed(mode: str) -> dict:
        runner.backend.extend_mode = mode  # read by init_forward at each batch
        try:
            whole = statistics.median(events_ms(lambda: runner.forward(batch), args.iters_prefill, warmup=2))
            parts = statistics.median(events_ms(chunked, args.iters_prefill, warmup=1))
            return {"ms": whole, "chunked_4x_ms": parts}
        except Exception as e:  # noqa: BLE001 - a failing kernel path is a result too
            return {"error": repr(e)[:300]}

    default_mode, default_pb = runner.backend.extend_mode, runner.backend.prefill_backend
    modes = ("paged", default_mode) if default_mode != "paged" else ("paged",)
    # the paged wrapper's kernels: the whole row in "paged" mode, the cached prefix in "ragged" mode
    pbs = [pb for pb in dict.fromkeys([default_pb, *getattr(args, "prefill_backends", "").split(",")]) if pb]
    by_pb: dict[str, dict] = {}
    for pb in pbs:
        runner.backend.set_prefill_backend(pb)
        by_pb[pb] = {}
        for mode in modes:
            by_pb[pb][mode] = timed(mode)
            print(f"prefill prefill_backend={pb} extend_mode={mode}: {by_pb[pb][mode]}", flush=True)
    runner.backend.extend_mode = default_mode
    runner.backend.set_prefill_backend(default_pb)
    by_mode = by_pb[default_pb]
    ms, ms_chunked = by_mode[default_mode]["ms"], by_mode[default_mode]["chunked_4x_ms"]
    floor_ms = flops / args.gemm_rate * 1e3
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.forward(batch)
        torch.cuda.synchronize()
    agg = {k: us / 1e3 for k, (us, _) in kernel_times(prof).items()}
    top = sorted(agg.items(), key=lambda kv: -kv[1])[:12]
    for k, v in top:
        print(f"  prefill kernel {v:8.2f} ms  {k}", flush=True)
    out = {"kernels_top_ms": top, "tokens": T, "flops": flops, "linear_params": lin, "attn_flops": attn_flops, "ms": ms,
           "floor_ms": floor_ms, "frac_of_floor": floor_ms / ms, "achieved_TFLOPs": flops / ms / 1e9,
           "chunked_4x_ms": ms_chunked, "chunked_frac_of_floor": floor_ms / ms_chunked,
           "extend_mode": default_mode, "prefill_backend": default_pb, "by_extend_mode": by_mode,
           "by_prefill_backend": by_pb}
    print(json.dumps(out), flush=True)
    del runner
    torch.cuda.empty_cache()
    return out


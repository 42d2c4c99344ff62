"""CPU decode-step benchmark: one step's time per CPU optimisation, against a memory-bandwidth floor.

    .venv/bin/python -m bench.cpu_decode [--threads 1] [--batches 1,8] [--contexts 200,800] [--json out.json]

Variants (cumulative, in the order of issue 22's profile; each is its own ModelRunner on the same
weights, all loaded at once):

==========  ===========================================================================
baseline    ``fused_ops=False``, ``cpu_linear=torch``, ``attention_backend=torch`` (211 GEMMs/step)
fused       + q/k/v and gate/up fused (121 GEMMs), still ``F.linear``
packed      + oneDNN weights packed once (``cpu_linear=onednn``)
paged       + the ``torch_paged`` page-level decode gather
cpu_paged   + the C++ paged decode kernel reading the pool in place (``cpu_paged``;
            ``bench/cpu_attention.py`` times it alone)
small_gemm  + the small-M GEMM kernel for the decode GEMMs (``cpu_linear=packed``), the
            norms, RoPE and SiLU·mul still torch ops
glue        + the ``decode_glue`` kernel between the GEMMs (``engine/torch_fused_ops.py``): the
            default configuration once ``make kernels`` built the kernels
bf16        the default configuration with ``dtype=bfloat16`` (weights and KV): the small-M kernel
            on bf16 weights up to ``BF16_SMALL_ROWS`` rows, oneDNN's native bf16 GEMMs (AMX /
            AVX512-BF16) above; not run by default, name it in ``--variants``; its greedy tokens
            may differ from the float32 ones
==========  ===========================================================================

For each batch B and context C: B rows of C tokens already in the pool, then ``--steps`` decode
steps that re-feed position C (the context stays C). Each repetition runs every variant once, the
order rotating, so load from other processes on the shared box hits all alike; figures are
medians over repetitions of the per-step mean, as wall time (``step_ms``) and as this thread's CPU
time (``cpu_ms``, ``time.thread_time``: with one torch thread the whole step runs on it, so it
leaves out the time other processes held the core; memory-bandwidth contention still shows).

Floor: the bytes one step must read (every GEMM weight incl. ``lm_head``, plus the K/V of B * C
tokens) over the machine's copy bandwidth, measured here as ``2 * bytes / time`` of a 256 MiB
``Tensor.copy_`` (STREAM's convention: read + write) on 1 and on 2 threads. ``x_floor`` =
step time / floor time (1.0 = at the floor), the weight and KV bytes in each variant's dtype.
``tokens_equal`` (per variant): its greedy tokens of the first step equal the first variant's.
JSON on stdout (or ``--json``), a table on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.results_file import print_result

VARIANTS = {
    "baseline": dict(fused_ops=False, cpu_linear="torch", attention_backend="torch"),
    "fused": dict(fused_ops=True, cpu_linear="torch", attention_backend="torch", glue=False),
    "packed": dict(fused_ops=True, cpu_linear="onednn", attention_backend="torch", glue=False),
    "paged": dict(fused_ops=True, cpu_linear="onednn", attention_backend="torch_paged", glue=False),
    "cpu_paged": dict(fused_ops=True, cpu_linear="onednn", attention_backend="cpu_paged", glue=False),
    "small_gemm": dict(fused_ops=True, cpu_linear="packed", attention_backend="cpu_paged", glue=False),
    "glue": dict(fused_ops=True, cpu_linear="packed", attention_backend="cpu_paged"),
    "bf16": dict(fused_ops=True, cpu_linear="packed", attention_backend="cpu_paged", dtype="bfloat16"),
}
DEFAULT_VARIANTS = [n for n in VARIANTS if n != "bf16"]


def copy_bandwidth(threads: int, mib: int = 256, reps: int = 7) -> float:
    """Bytes/s of ``dst.copy_(src)`` counted as read + write (median of ``reps``) on ``threads``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(mib << 18)  # float32: mib MiB
        dst = torch.empty_like(src)
        dst.copy_(src)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t)
        return 2 * src.numel() * 4 / statistics.median(ts)
    finally:
        torch.set_num_threads(old)


def weight_bytes(model) -> int:
    """Bytes of every GEMM weight one step reads (decoder linears and lm_head; not the embedding),
    from each linear's shape: a packed model has released its row-major weights (shape [0]), and the
    fused q/k/v and gate/up modules are not in the module tree, their unfused originals are."""
    size = model.model.embed_tokens.weight.element_size()
    n = sum(m.in_features * m.out_features for name, m in model.named_modules()
            if name.startswith("model.layers.") and hasattr(m, "in_features"))
    return (n + model.lm_head.in_features * model.lm_head.out_features) * size


class Setup:
    """B rows of ``ctx`` tokens on one runner, and the decode step over them."""

    def __init__(self, runner, batch: int, ctx: int, seed: int):
        self.runner = runner
        r2t = runner.req_to_token_pool
        self.rows = [r2t.alloc() for _ in range(batch)]
        self.slots = []
        for row in self.rows:
            s = runner.allocator.alloc_slots(0, ctx + 1, None)
            r2t.write(row, 0, s)
            self.slots.append(s)
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(100, runner.vocab_size - 100, (batch,), generator=g).tolist()
        self.ctx = ctx

    def step(self) -> list[int]:
        from engine.forward_batch import ForwardBatch

        r = self.runner
        b = ForwardBatch.decode(self.rows, [self.ctx] * len(self.rows), self.tokens, r.req_to_token_pool.req_to_token)
        return r.forward(b).argmax(-1).tolist()

    def close(self) -> None:
        for row, s in zip(self.rows, self.slots):
            self.runner.allocator.free_slots(s[::self.runner.page_size])
            self.runner.req_to_token_pool.free(row)


def measure(runners: dict, batch: int, ctx: int, steps: int, repeats: int) -> dict:
    setups = {n: Setup(r, batch, ctx, seed=batch * 1000 + ctx) for n, r in runners.items()}
    names = list(runners)
    per = {n: [] for n in names}
    cpu = {n: [] for n in names}
    toks = {n: None for n in names}
    try:
        for n in names:  # warm-up (first-call allocations, oneDNN primitive creation)
            toks[n] = setups[n].step()
        for rep in range(repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                t, c = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    setups[n].step()
                per[n].append((time.perf_counter() - t) / steps)
                cpu[n].append((time.thread_time() - c) / steps)
    finally:
        for s in setups.values():
            s.close()
    return dict(step_s={n: statistics.median(v) for n, v in per.items()},
                cpu_s={n: statistics.median(v) for n, v in cpu.items()},
                tokens_equal={n: toks[n] == toks[names[0]] for n in names})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="200,800")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"subset of {list(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=5, help="decode steps per measurement")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; one of {list(VARIANTS)}")
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.models.cpu_linear import bf16_gemm_supported

    bw = {t: copy_bandwidth(t) for t in (1, 2)}
    torch.set_num_threads(args.threads)
    pages = max(batches) * (-(-(max(contexts) + 1) // 16)) + 8
    runners = {}
    for n in names:
        cfg = dict(VARIANTS[n])
        glue = cfg.pop("glue", True)  # not an engine option: the bench turns the kernel off on the model
        runners[n] = ModelRunner(EngineConfig(model=args.model, page_size=16, num_pages=pages,
                                              max_running_requests=max(batches), max_context=max(contexts) + 16,
                                              torch_threads=args.threads, **cfg))
        if not glue and runners[n].model._fused is not None:
            runners[n].model._fused.glue = None
    r0 = next(iter(runners.values()))
    mc = r0.model_config
    wbytes = {n: weight_bytes(r.model) for n, r in runners.items()}
    load_before = os.getloadavg()
    results = []
    for b in batches:
        for c in contexts:
            m = measure(runners, b, c, args.steps, args.repeats)
            base, cbase = m["step_s"][names[0]], m["cpu_s"][names[0]]
            for n in names:
                kv = b * c * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * runners[n].kv_pool.k_buffers[0].element_size()
                floor = {t: (wbytes[n] + kv) / bw[t] for t in bw}
                s, cs = m["step_s"][n], m["cpu_s"][n]
                results.append(dict(variant=n, batch=b, ctx=c, step_ms=round(s * 1e3, 2), cpu_ms=round(cs * 1e3, 2),
                                    speedup_vs_first=round(base / s, 3), cpu_speedup_vs_first=round(cbase / cs, 3),
                                    x_floor_1t=round(s / floor[1], 2), x_floor_2t=round(s / floor[2], 2),
                                    tokens_equal=m["tokens_equal"][n]))
                print(f"B={b} ctx={c} {n:9} {s * 1e3:8.2f} ms (cpu {cs * 1e3:.2f})  x{base / s:.2f} (cpu x{cbase / cs:.2f})"
                      f"  floor-1t x{s / floor[1]:.2f}",
                      file=sys.stderr, flush=True)
    out = dict(bench="cpu_decode", model=args.model, threads=args.threads, torch=torch.__version__,
               bf16_gemm_native=bf16_gemm_supported(),
               cpus=os.cpu_count(), steps=args.steps, repeats=args.repeats,
               copy_bandwidth_gb_s={str(t): round(v / 1e9, 2) for t, v in bw.items()},
               weight_bytes=wbytes, load_avg_before=load_before, load_avg_after=os.getloadavg(),
               results=results,
               note="x_floor = step time / ((weight + KV bytes) / copy bandwidth); speedup vs the first variant")
    print_result(out, args.json)
    print(f"{'B':>3} {'ctx':>5} {'variant':9} {'step ms':>8} {'cpu ms':>8} {'speedup':>8} {'cpu spd':>8} "
          f"{'x floor 1t':>10} {'x floor 2t':>10} tokens=", file=sys.stderr)
    for r in results:
        print(f"{r['batch']:>3} {r['ctx']:>5} {r['variant']:9} {r['step_ms']:>8} {r['cpu_ms']:>8} "
              f"{r['speedup_vs_first']:>8} {r['cpu_speedup_vs_first']:>8} "
              f"{r['x_floor_1t']:>10} {r['x_floor_2t']:>10} {r['tokens_equal']}", file=sys.stderr)
    print(f"copy bandwidth GB/s {out['copy_bandwidth_gb_s']}; load average before {load_before}, "
          f"after {out['load_avg_after']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

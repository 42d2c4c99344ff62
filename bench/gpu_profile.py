"""Profile sections of the GPU benchmark: where a decode step's time goes.

  host_profile  cProfile of the host side of a graph decode step (``runner.forward`` at B=1 and
                B=128, context 4096, GPU idle before each call): the time a scheduler that syncs
                every step leaves the GPU idle
  profile       per-kernel GPU time of one eager decode step (torch.profiler), grouped by kernel
                name, at B=1 and B=128 (context 1024): which kernels keep a step from the floor
  graph_profile the same for CUDA-graph replays (what serving runs), with the idle time between the
                graph's kernels, for each ``--profile-cases`` BxCONTEXT (default B=1 and B=32 at
                context 1024)
"""

from __future__ import annotations

import torch

from bench.gpu_runner import PAGE_SIZE, build_runner, decode_batch, decode_rows
from bench.gpu_timing import kernel_times


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"1x1024,32x4096" -> [(1, 1024), (32, 4096)] (batch, context). Raises ValueError on another form."""
    cases = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        b, sep, c = item.partition("x")
        if not sep or not b.isdigit() or not c.isdigit() or int(b) < 1 or int(c) < 1:
            raise ValueError(f"case {item!r}: expected BxCONTEXT, e.g. 32x1024")
        cases.append((int(b), int(c)))
    if not cases:
        raise ValueError("no cases")
    return cases


def host_profile(args) -> dict:
    """Host time of a graph decode step by function (see the module docstring)."""
    import cProfile
    import io
    import pstats

    C, ps, maxB = 4096, PAGE_SIZE, 128
    runner, _ = build_runner(args, maxB, C + ps, maxB * (-(-(C + 1) // ps)) + 8)
    rows, slots = decode_rows(runner, maxB, C)
    out = {}
    for B in (1, maxB):
        batch = decode_batch(rows, slots, C, [1] * B)
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


def profile(args) -> dict:
    """GPU time of an eager decode step by kernel (see the module docstring)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    batches = [1, 128]
    C, ps = 1024, PAGE_SIZE
    runner, _ = build_runner(args, max(batches), C + ps, max(batches) * (C // ps + 2) + 8)
    for buf in runner.kv_pool.buffers():
        buf.normal_()
    out = {}
    for B in batches:
        rows, slots = decode_rows(runner, B, C)
        batch = decode_batch(rows, slots, C, [1] * B)
        with torch.inference_mode():
            for _ in range(3):
                runner.model(batch, runner.backend)
            torch.cuda.synchronize()
            steps = 5
            with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    runner.model(batch, runner.backend)
                torch.cuda.synchronize()
        agg = kernel_times(prof)
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




def graph_profile(args) -> dict:
    """Kernels of CUDA-graph decode replays by name, and the idle time between them (module docstring)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    from bench.gpu_timing import kernel_intervals, merged_busy_us

    cases = args.profile_cases
    maxB, maxC = max(b for b, _ in cases), max(c for _, c in cases)
    runner, _ = build_runner(args, maxB, maxC + PAGE_SIZE, maxB * (maxC // PAGE_SIZE + 2) + 8)
    for buf in runner.kv_pool.buffers():
        buf.normal_()
    rows, slots = decode_rows(runner, maxB, maxC)
    out = {}
    for B, C in cases:
        batch = decode_batch(rows, slots, C, [1] * B)
        gr = runner.graph_runner
        runner.forward(batch)  # plans and fills the bucket's inputs
        replay = gr.graphs[gr.bucket_for(B)].replay
        for _ in range(5):
            replay()
        torch.cuda.synchronize()
        steps = 10
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                replay()
            torch.cuda.synchronize()
        ks = kernel_intervals(prof)
        span_us = ks[-1][1] - ks[0][0]
        busy_us = merged_busy_us(ks)
        agg = kernel_times(prof)
        top = sorted(([k, v[0] / steps, v[1] // steps] for k, v in agg.items()), key=lambda r: -r[1])
        out[f"{B}x{C}"] = {"kernels_per_step": len(ks) / steps, "span_ms_per_step": span_us / steps / 1e3,
                       "busy_ms_per_step": busy_us / steps / 1e3, "idle_ms_per_step": (span_us - busy_us) / steps / 1e3,
                       "top_us_per_step": top[:16]}
        print(f"graph_profile B={B} ctx={C}: {len(ks) / steps:.0f} kernels/step, span {span_us / steps / 1e3:.3f} ms, "
              f"busy {busy_us / steps / 1e3:.3f} ms, idle {(span_us - busy_us) / steps / 1e3:.3f} ms per step", flush=True)
        for k, us, n in top[:16]:
            print(f"  {us:8.1f} us  x{n:4d}  {k}", flush=True)
    del runner
    torch.cuda.empty_cache()
    return out

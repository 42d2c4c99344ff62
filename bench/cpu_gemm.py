"""CPU GEMMs of a decode step: the small-M kernel against oneDNN (packed), F.linear (MKL) and the
copy-bandwidth floor, per row count M.

    .venv/bin/python -m bench.cpu_gemm [--threads 1,2] [--rows 1,2,4,8,16,32,64] [--json out.json]

The weights are SmolLM2-135M's linears as the engine runs them (30 layers of fused q/k/v 576->960,
o 576->576, fused gate/up 576->3072, down 1536->576, then the 49152-row lm_head), random float32,
each packed the way ``PackedLinear`` packs it. One measurement = every GEMM once, in order (weights
come from memory, as in a step); the three paths alternate per repetition and the figure is the
median. ``floor_ms`` = weight bytes / copy bandwidth measured in the same run; ``x_floor`` = time /
floor. Needs the kernel built (``make kernels``). JSON on stdout (or ``--json``), a table on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.cpu_decode import copy_bandwidth
from bench.results_file import print_result

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from engine.cpu_kernels import SMALL_GEMM

    mod, why = SMALL_GEMM.load()
    if mod is None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for n, k in SHAPES]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 8) for w in ws]
    small = [torch.ops.halfmoon.small_gemm_pack(w) for w in ws]
    nbytes = sum(w.numel() * 4 for w in ws)
    rows_out = []
    bw = {}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bw[threads] = copy_bandwidth(threads)
        floor = nbytes / bw[threads]
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
            paths = {
                "small_gemm": lambda: [torch.ops.halfmoon.small_gemm(xs[w.shape[1]], p, w.shape[0], None)
                                       for w, p in zip(ws, small)],
                "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                   for w, p in zip(ws, onednn)],
                "f_linear": lambda: [F.linear(xs[w.shape[1]], w) for w in ws],
            }
            got = {n: [] for n in paths}
            for rep in range(args.repeats):
                for n in (list(paths) if rep % 2 == 0 else list(paths)[::-1]):
                    got[n].append(_time(paths[n], 1))
            row = dict(threads=threads, rows=m, floor_ms=round(floor * 1e3, 2))
            for n, ts in got.items():
                row[f"{n}_ms"] = round(statistics.median(ts) * 1e3, 2)
            row["x_floor"] = round(row["small_gemm_ms"] / row["floor_ms"], 2)
            row["onednn_over_small"] = round(row["onednn_ms"] / row["small_gemm_ms"], 2)
            rows_out.append(row)
    out = dict(bench="cpu_gemm", weight_bytes=nbytes, copy_bandwidth_gbs={str(k): round(v / 1e9, 2) for k, v in bw.items()},
               repeats=args.repeats, table=rows_out)
    print_result(out, args.json)
    print(f"{'thr':>3} {'M':>3} {'floor ms':>8} {'small_gemm':>10} {'oneDNN':>8} {'F.linear':>8} {'x floor':>7} "
          f"{'oneDNN/small':>12}", file=sys.stderr)
    for r in rows_out:
        print(f"{r['threads']:>3} {r['rows']:>3} {r['floor_ms']:>8} {r['small_gemm_ms']:>10} {r['onednn_ms']:>8} "
              f"{r['f_linear_ms']:>8} {r['x_floor']:>7} {r['onednn_over_small']:>12}", file=sys.stderr)
    print(f"copy bandwidth GB/s {out['copy_bandwidth_gbs']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

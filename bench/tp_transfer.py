"""Heterogeneous P/D TP KV writes: serving's head-blocked writes vs strided per-rank-pair puts and a
staging gather with a scatter on D (not a test).

    .venv/bin/python -m bench.tp_transfer [--reps 4] [--pages 16,128,512] [--cases 2-1,1-2,3-2]
                                          [--out bench/results/tp_transfer_cpu.json]

Pools shaped like SmolLM2-135M's (30 layers, 3 kv heads, head_dim 64, 4-byte elements, page 16,
page_major: 720 KiB a page of every head), split P TP=2 -> D TP=1 (P ranks hold heads [0,2) and
[2,3)), P TP=1 -> D TP=2 and P TP=3 -> D TP=2 (by default), each rank a process with its own transfer engine over UCX ``sm``
(bench/tp_transfer_worker.py), P ranks writing in parallel. A delta of N pages in runs of 8 (source
and destination pages permuted independently) moves, in every case, N x 720 KiB.

Methods:
  blocked  what serving does (pd_common/head_slices.py, staged_writes.py, head_blocks.py): one put
           per page of a contiguous head block, from the P page itself where the P rank sends all
           of its heads, else gathered in chunks through its 64 MiB staging area; into the whole D
           page where the D rank receives all its heads from this P rank, else head-blocked at the
           block's offset of D's page and rewritten token-major by D afterwards (unblock, timed)
  strided  what serving did before (bench/strided_slices.py): one put per (page, layer, K/V, token)
           of a head range's row, or one per page where both sides hold exactly that range
  gather   the P rank copies each D rank's head range of the delta pages into its registered
           staging area (torch index_select, timed), then: where the D rank holds exactly that head
           range, one put per page straight into D's pool (the engine merges page runs); else one
           put into D's staging area and D scatters it into its pool (index_copy_, timed)
  ceiling  P TP=1 -> D TP=1, the same pages: one put per page (page runs merged), no gather

ms: from the first P rank starting (descriptors are built inside the timing, as the serving path
builds them per batch) to every put complete, plus D's scatter; median of the runs after the
warm-up. After the warm-up every D rank checks that its pool holds exactly the expected elements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

from bench.transfer_peers import ROOT
from bench.transfer_worker import Proc
from bench.tp_transfer_worker import ITEM, SHAPE
from engine.distributed.shard import even_split
from pd_common import RankRegion, head_cuts, plan_rank_writes, rank_blocks

HEADS, RUN = 3, 8
PAGE_BYTES = SHAPE.stride(HEADS)


def delta_pages(n: int, pool_pages: int, seed: int) -> tuple[list[int], list[int]]:
    """Source and destination pages of an n-page delta: n / RUN runs of RUN pages each side."""
    rng = np.random.default_rng(seed)
    runs = max(1, n // RUN)
    out = []
    for _ in range(2):
        slots = rng.permutation(pool_pages // RUN)[:runs]
        out.append([int(s) * RUN + i for s in slots for i in range(min(RUN, n))])
    return out[0], out[1]


class Stack:
    """P ranks and D ranks (processes) of one (P TP, D TP) split, P connected to every D rank."""

    def __init__(self, p_tp: int, d_tp: int, pool_pages: int, max_pages: int):
        def spawn(side, tp):
            procs = []
            for r in range(tp):
                lo, hi = even_split(HEADS, tp, r)
                procs.append(Proc([side, str(r), str(lo), str(hi), str(pool_pages), str(max_pages)], {},
                                  module="bench.tp_transfer_worker"))
            infos = [p.read() for p in procs]
            regions = [RankRegion(r, *even_split(HEADS, tp, r), i["base"], i["length"])
                       for r, i in enumerate(infos)]
            return procs, infos, regions
        self.p, _, self.p_regions = spawn("p", p_tp)
        self.d, self.d_infos, self.d_regions = spawn("d", d_tp)
        dsts = [dict(i, rank=r) for r, i in enumerate(self.d_infos)]
        for p in self.p:
            p.ask({"cmd": "connect", "dsts": dsts})

    def writes(self, method: str, n: int) -> tuple[dict[int, list[dict]], dict[int, list[dict]]]:
        """Per P rank, its writes' specs; per D rank, the staged writes it scatters."""
        per_p: dict[int, list[dict]] = {}
        staged: dict[int, list[dict]] = {}
        p_off: dict[int, int] = {}
        d_off: dict[int, int] = {}
        plan = plan_rank_writes(self.p_regions, self.d_regions)
        for w in plan:
            src, dst = self.p_regions[w.src_rank], self.d_regions[w.dst_rank]
            rng = (w.head_start, w.head_end)
            spec = {"lo": w.head_start, "hi": w.head_end, "mode": "blocked" if method == "blocked" else "strided",
                    "dst_region": [dst.rank, dst.head_start, dst.head_end, dst.base, dst.length]}
            whole_src, whole_dst = rng == (src.head_start, src.head_end), rng == (dst.head_start, dst.head_end)
            if method == "gather" and not (whole_src and whole_dst):
                elems = n * SHAPE.stride(w.head_end - w.head_start) // ITEM
                spec["p_off"] = p_off.get(w.src_rank, 0)
                p_off[w.src_rank] = spec["p_off"] + elems
                if whole_dst:
                    spec["mode"] = "gather-direct"
                else:
                    spec["mode"] = "gather-staged"
                    off = d_off.get(w.dst_rank, 0)
                    d_off[w.dst_rank] = off + elems
                    spec["d_stage"] = self.d_infos[w.dst_rank]["stage_base"] + off * ITEM
                    staged.setdefault(w.dst_rank, []).append({"lo": w.head_start, "hi": w.head_end, "d_off": off})
            per_p.setdefault(w.src_rank, []).append(spec)
        if method == "blocked":  # D ranks whose pages arrive head-blocked: their blocks
            for d in self.d_regions:
                blocks = rank_blocks(head_cuts(plan), d.head_start, d.head_end)
                if len(blocks) > 1:
                    staged[d.rank] = [list(b) for b in blocks]
        return per_p, staged

    def run(self, method: str, src: list[int], dst: list[int]) -> dict:
        per_p, staged = self.writes(method, len(src))
        for r, ws in per_p.items():  # every P rank starts before any answer is read: they run in parallel
            self.p[r].p.stdin.write(json.dumps({"cmd": "run", "writes": ws, "src_pages": src,
                                                "dst_pages": dst}) + "\n")
            self.p[r].p.stdin.flush()
        rs = [self.p[r].read(600) for r in per_p]
        cmd, key = ("unblock", "blocks") if method == "blocked" else ("scatter", "staged")
        scatter = [self.d[d].ask({"cmd": cmd, key: s, "dst_pages": dst}, 600)["seconds"]
                   for d, s in staged.items()]  # D ranks one after another; the max is what counts
        put_s = max(r["t_end"] for r in rs) - min(r["t_start"] for r in rs)
        return {"s": put_s + max(scatter, default=0.0), "gather_s": max(r["gather_s"] for r in rs),
                "scatter_s": max(scatter, default=0.0), "descs": sum(r["descs"] for r in rs),
                "staging_peak": max(r.get("staging_peak", 0) for r in rs),
                "staging_in_use": max(r.get("staging_in_use", 0) for r in rs),
                "staging_register_ms": max(r.get("staging_register_ms", 0.0) for r in rs)}

    def check(self, src: list[int], dst: list[int]) -> bool:
        return all(d.ask({"cmd": "check", "src_pages": src, "dst_pages": dst}, 600)["ok"] for d in self.d)

    def zero(self) -> None:
        for d in self.d:
            d.ask({"cmd": "zero"})

    def close(self) -> None:
        for p in self.p + self.d:
            p.close()


def measure(stack: Stack, method: str, src: list[int], dst: list[int], reps: int) -> dict:
    """Median figures of ``reps - 1`` runs after a warm-up whose result the D ranks check."""
    stack.zero()
    runs = [stack.run(method, src, dst)]
    ok = stack.check(src, dst)
    runs = [stack.run(method, src, dst) for _ in range(reps - 1)]
    med = {k: statistics.median(r[k] for r in runs) for k in ("s", "gather_s", "scatter_s")}
    nbytes = len(src) * PAGE_BYTES
    return {"ms": 1e3 * med["s"], "gbps": nbytes / med["s"] / 1e9, "puts": runs[0]["descs"],
            "gather_ms": 1e3 * med["gather_s"], "scatter_ms": 1e3 * med["scatter_s"], "bytes": nbytes,
            "verified": ok, "runs_ms": [round(1e3 * r["s"], 3) for r in runs],
            "staging_peak_bytes": max(r["staging_peak"] for r in runs),
            "staging_in_use_after": max(r["staging_in_use"] for r in runs),
            "staging_register_ms": max(r["staging_register_ms"] for r in runs)}


def table(report: dict) -> str:
    lines = [f"{'case':<9}{'pages':>6} | {'blocked ms':>10} {'GB/s':>5} {'puts':>5} {'unblk ms':>8} | "
             f"{'strided ms':>10} {'GB/s':>5} {'puts':>7} | {'gather ms':>9} {'GB/s':>5} {'puts':>5} "
             f"{'(gath+scat ms)':>15} | {'ceiling ms':>10} {'GB/s':>5} {'puts':>5} | ok"]
    for row in report["rows"]:
        b, s, g, c = row["blocked"], row["strided"], row["gather"], row["ceiling"]
        ok = "yes" if all(x["verified"] for x in (b, s, g, c)) else "NO"
        lines.append(f"{row['case']:<9}{row['pages']:>6} | {b['ms']:>10.2f} {b['gbps']:>5.2f} {b['puts']:>5} "
                     f"{b['scatter_ms']:>8.2f} | {s['ms']:>10.2f} {s['gbps']:>5.2f} {s['puts']:>7} | "
                     f"{g['ms']:>9.2f} {g['gbps']:>5.2f} {g['puts']:>5} "
                     f"{g['gather_ms']:>7.2f}+{g['scatter_ms']:<7.2f} | {c['ms']:>10.2f} {c['gbps']:>5.2f} "
                     f"{c['puts']:>5} | {ok}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4, help="runs per figure (the first is a warm-up)")
    ap.add_argument("--pages", default="16,128,512", help="delta sizes in pages")
    ap.add_argument("--cases", default="2-1,1-2,3-2", help="P TP-D TP splits of the 3 kv heads")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "tp_transfer_cpu.json"))
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps: at least 2 (the first run is a warm-up)")
    sizes = [int(x) for x in args.pages.split(",")]
    try:
        cases = [tuple(int(t) for t in c.split("-")) for c in args.cases.split(",")]
    except ValueError:
        ap.error(f"--cases: comma-separated P-D pairs like 2-1, got {args.cases!r}")
    if any(len(c) != 2 or not 1 <= min(c) <= max(c) <= HEADS for c in cases):
        ap.error(f"--cases: each TP size between 1 and {HEADS}, got {args.cases!r}")
    pool = (max(sizes) // RUN + 4) * RUN
    deltas = {n: delta_pages(n, pool, seed=n) for n in sizes}
    ceiling = Stack(1, 1, pool, max(sizes))
    try:
        ceil = {n: measure(ceiling, "strided", *deltas[n], args.reps) for n in sizes}
    finally:
        ceiling.close()
    rows = []
    for p_tp, d_tp in cases:
        stack = Stack(p_tp, d_tp, pool, max(sizes))
        try:
            for n in sizes:
                row = {"case": f"P{p_tp}->D{d_tp}", "pages": n, "ceiling": ceil[n]}
                for m in ("blocked", "strided", "gather"):
                    row[m] = measure(stack, m, *deltas[n], args.reps)
                rows.append(row)
                print(f"{row['case']} {n} pages: blocked {row['blocked']['ms']:.2f} ms, strided "
                      f"{row['strided']['ms']:.2f} ms, gather {row['gather']['ms']:.2f} ms, "
                      f"ceiling {ceil[n]['ms']:.2f} ms", flush=True)
        finally:
            stack.close()
    report = {"model": "SmolLM2-135M pools (30 layers, 3 kv heads, head_dim 64, 4 B, page 16)",
              "transport": "UCX sm, one process per rank", "reps_after_warmup": args.reps - 1,
              "cpus": os.cpu_count(), "loadavg": os.getloadavg(), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    text = table(report)
    with open(args.out.removesuffix(".json") + "_table.txt", "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

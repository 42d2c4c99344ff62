"""The transfer benchmark's report: GB/s and GB per CPU-second per engine and workload, ratios of
medians between engines, the KV layouts against one contiguous put; as JSON and as tables."""

from __future__ import annotations

import os
import statistics
import time

# (numerator, denominator) engines whose median GB/s the report divides
RATIOS = [("halfmoon-tcp", "mooncake-tcp"), ("halfmoon-tcp", "nixl-tcp"), ("halfmoon-sm", "nixl-sm"),
          ("halfmoon-sm", "memcpy")]


def build_report(times: dict, cpus: dict, workloads: dict, wnames: list[str], live: list[str], reps: int,
                 skipped: dict, verified: dict) -> dict:
    """The JSON report of timed runs: ``times`` / ``cpus`` [engine][workload] -> seconds per run
    (after the warm-up), ``reps`` of them."""
    results = {}
    for e in live:
        results[e] = {}
        for w in wnames:
            nbytes = sum(n for _, _, n in workloads[w])
            ts = times[e][w]
            gbs = sorted(nbytes / t / 1e9 for t in ts)
            results[e][w] = {"bytes": nbytes, "ops": len(workloads[w]), "seconds": ts,
                             "gbps_median": statistics.median(gbs), "gbps_min": gbs[0],
                             "gbps_max": gbs[-1], "us_median": statistics.median(ts) * 1e6,
                             "cpu_seconds": cpus[e][w],
                             "gb_per_cpu_s_median": statistics.median(
                                 nbytes / max(c, 1e-6) / 1e9 for c in cpus[e][w])}

    def med(e, w):
        return results.get(e, {}).get(w, {}).get("gbps_median")

    ratios = {}
    for w in wnames:
        r = {}
        for num, den in RATIOS:
            if med(num, w) and med(den, w):
                r[f"{num}/{den}"] = med(num, w) / med(den, w)
        ratios[w] = r
    kv = {}
    for e in live:
        if all(med(e, w) for w in ("kv_layer", "kv_contiguous")):
            kv[e] = {"per_layer_over_contiguous": med(e, "kv_layer") / med(e, "kv_contiguous")}
            if med(e, "kv_page_major"):
                kv[e]["page_major_over_contiguous"] = med(e, "kv_page_major") / med(e, "kv_contiguous")
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "reps": reps,
            "cpus": os.cpu_count(), "results": results, "ratios": ratios, "kv_layout": kv,
            "skipped": skipped, "verified": verified,
            "workload_bytes": {w: sum(n for _, _, n in workloads[w]) for w in wnames},
            "workload_ops": {w: len(workloads[w]) for w in wnames}}


def print_report(report: dict) -> None:
    """The report's tables on stdout."""
    results, ratios, kv = report["results"], report["ratios"], report["kv_layout"]
    ops = report["workload_ops"]
    live, wnames = list(results), list(ops)
    print(f"\nGB/s, median [min-max] of {report['reps']} runs (after 1 warm-up), alternating engines")
    head = f"{'engine':<14}" + "".join(f"{w + ' (' + str(ops[w]) + ')':>26}" for w in wnames)
    print(head)
    for e in live:
        cells = []
        for w in wnames:
            r = results[e][w]
            cells.append(f"{r['gbps_median']:6.2f} [{r['gbps_min']:5.2f}-{r['gbps_max']:5.2f}]")
        print(f"{e:<14}" + "".join(f"{c:>26}" for c in cells))
    print("\nCPU efficiency: GB moved per CPU-second of initiator + target processes (all threads),"
          " median; less sensitive to a loaded machine than wall-clock GB/s")
    print(f"{'engine':<14}" + "".join(f"{w:>16}" for w in wnames))
    for e in live:
        print(f"{e:<14}" + "".join(f"{results[e][w]['gb_per_cpu_s_median']:16.2f}" for w in wnames))
    if "kv_one_page" in wnames:
        print("\nkv_one_page batch latency, median µs: " + ", ".join(
            f"{e} {results[e]['kv_one_page']['us_median']:.0f}" for e in live))
    print("\nratios of medians:")
    for w, r in ratios.items():
        print(f"  {w:<14} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    print("\nKV layout: per-layer puts / one contiguous put, page-major / contiguous:")
    for e, r in kv.items():
        print(f"  {e:<14} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    for e, why in report["skipped"].items():
        print(f"skipped {e}: {why}")
    print(f"verified (target bytes after the warm-up round): {report['verified']}")

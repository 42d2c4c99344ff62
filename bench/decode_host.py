"""Decode host cost benchmark: D's host work per running request per step, by stream path.

    PYTHONPATH=. python -m bench.decode_host [--batches 32,128,256] [--max-tokens 48] [--model tiny|real] \
        [--modes threads,aio] [--output bench/results/decode_host_cpu.json]

Modes (D's flags): ``off``: one server thread per stream, one DecodeChunk per token
(``--stream-server threads --stream-coalesce off``); ``threads``: the same, a lagging stream's tokens
in one chunk (``--stream-coalesce on``, ``decode_svc.streams``); ``aio``: streams as tasks on one
``grpc.aio`` loop fed once per step (``--stream-server aio``, the default, ``decode_svc.stream_hub``).
For each mode one ``halfmoon up`` stack
(1P1D, ``--max-running-requests`` = the largest batch; all up at once, the modes alternating per
batch size) serves, for each batch size B, B concurrent
greedy ``ignore_eos`` requests of short distinct prompts and ``--max-tokens`` outputs through the
router's gRPC ``Generate`` (one asyncio client). From D's ``/metrics`` over each run:
``halfmoon_decode_step_seconds_total{part=host|device}`` and ``halfmoon_decode_step_requests_total``
give the host µs per request-step and the device ms per step (``decode_svc.step_clock``); plus output
tok/s, D's chunks per token as the client saw them (router relays one response per D chunk) and the
ITL p50 per token; D's process CPU µs per request-step (``process_cpu_seconds_total``:
unlike the wall-time split, not inflated when the OS runs other processes). Ratios are the last mode / the first one, of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.decode_memory import MODEL, UpStack, _metric
from bench.request import BenchRequest
from bench.results_file import write_result
from bench.router_target import RouterTarget
from bench.stats import distribution

_STEP = "halfmoon_decode_step_seconds_total"
_REQS = "halfmoon_decode_step_requests_total"
_TOKS = "halfmoon_decode_generated_tokens_total"


def _d_counters(metrics: str) -> dict:
    return {"host": _metric(metrics, f'{_STEP}{{part="host"}}'), "device": _metric(metrics, f'{_STEP}{{part="device"}}'),
            "request_steps": _metric(metrics, _REQS), "tokens": _metric(metrics, _TOKS),
            "cpu": _metric(metrics, "process_cpu_seconds_total")}


async def _batch(target: RouterTarget, b: int, max_tokens: int) -> list:
    reqs = [BenchRequest(prompt=f"Request {i}: count upwards from {i}:", max_tokens=max_tokens,
                         ignore_eos=True, temperature=0.0) for i in range(b)]
    return await asyncio.gather(*(target.generate(r) for r in reqs))


def run_batch(stack: UpStack, b: int, max_tokens: int) -> dict:
    """B concurrent requests on ``stack``; D's step split and the client's view of them."""
    ep = stack.endpoints
    dec = ep["decode"][0]["metrics"]

    async def go():
        t = RouterTarget(ep["router"]["grpc"], api_key=ep.get("api_key") or None)
        await t.start()
        try:
            await _batch(t, min(b, 8), 4)  # warm: router channels, D's first steps
            c0 = _d_counters(dec)
            t0 = time.perf_counter()
            recs = await _batch(t, b, max_tokens)
            return recs, time.perf_counter() - t0, c0
        finally:
            await t.close()

    recs, total, c0 = asyncio.run(go())
    c1 = _d_counters(dec)
    d = {k: c1[k] - c0[k] for k in c0}
    toks = sum(len(r.token_ids) for r in recs)
    chunks = sum(len(r.chunk_tokens) for r in recs)
    itl = [(r.chunk_times[k] - r.chunk_times[k - 1]) / r.chunk_tokens[k]
           for r in recs for k in range(1, len(r.chunk_times))]
    return {"batch": b, "requests": len(recs), "failed": sum(not r.ok for r in recs),
            "errors": sorted({r.error for r in recs if r.error})[:3],
            "output_tokens": toks, "total_s": round(total, 2), "output_tok_s": round(toks / total, 1),
            "host_us_per_request_step": round(1e6 * d["host"] / d["request_steps"], 1) if d["request_steps"] else None,
            "device_us_per_request_step": round(1e6 * d["device"] / d["request_steps"], 1) if d["request_steps"] else None,
            "host_share": round(d["host"] / (d["host"] + d["device"]), 3) if d["host"] + d["device"] else None,
            # D's CPU time (all threads) per request-step: on a shared box the wall-time split above
            # also counts the time the OS ran other processes; CPU time does not
            "d_cpu_us_per_request_step": round(1e6 * d["cpu"] / d["request_steps"], 1) if d["request_steps"] else None,
            "request_steps": int(d["request_steps"]),
            "chunks_per_token": round(chunks / toks, 3) if toks else None,
            "itl_ms_per_token": distribution(itl, 1000)}


def tiny_model(tmp: Path) -> Path:
    """A directory with the default model's tokenizer and a 2-layer, 64-wide config of its
    architecture (vocabulary kept), for ``--load-format dummy``: the host path per token is the
    same as the real model's, the forward a small part of the step even on a shared CPU."""
    from engine.model_store import resolve_model

    src = Path(resolve_model(MODEL))
    dst = tmp / "tiny-model"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


MODES = {"off": "--stream-server threads --stream-coalesce off",
         "threads": "--stream-server threads --stream-coalesce on",
         "aio": "--stream-server aio --stream-coalesce on"}


def _stack(mode: str, top: int, tmp: Path, model: list[str], extra: str) -> UpStack:
    return UpStack(f"{MODES[mode]} --max-running-requests {top}{extra}",
                   [f"--prefill-args=--max-running-requests {top}", *model], tmp / f"mode-{mode}")


def _median_run(runs: list[dict]) -> dict:
    """One run's figures: the median of each number over ``runs`` (the others from the first);
    every run under ``runs``."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(r[k] is not None for r in runs):
            out[k] = statistics.median(r[k] for r in runs)
    p50 = [r["itl_ms_per_token"]["p50"] for r in runs if r["itl_ms_per_token"].get("p50") is not None]
    out["itl_p50_ms"] = round(statistics.median(p50), 2) if p50 else None
    out["runs"] = runs
    return out


def bench(modes: list[str], batches: list[int], max_tokens: int, tmp: Path, model: list[str], extra: str = "",
          repeat: int = 1) -> dict:
    """All stacks up at once, the modes alternating per batch size (and the whole sweep repeated),
    so that the load of a shared machine drifts over every mode alike."""
    runs = {m: {str(b): [] for b in batches} for m in modes}
    with contextlib.ExitStack() as ex:
        stacks = {m: ex.enter_context(_stack(m, max(batches), tmp, model, extra)) for m in modes}
        for _ in range(repeat):
            for b in batches:
                for m in modes:
                    r = run_batch(stacks[m], b, max_tokens)
                    runs[m][str(b)].append(r)
                    print(json.dumps({m: {k: v for k, v in r.items() if k != "itl_ms_per_token"}}), flush=True)
    return {m: {b: _median_run(rs) for b, rs in per.items()} for m, per in runs.items()}


def _table(res: dict, batches: list[int], first: str, last: str) -> str:
    keys = ("output_tok_s", "host_us_per_request_step", "device_us_per_request_step", "d_cpu_us_per_request_step",
            "host_share",
            "chunks_per_token", "failed")
    rows = [("B", "metric", first, last, f"{last}/{first}")]
    for b in batches:
        off, on = res[first][str(b)], res[last][str(b)]
        for k in keys:
            a, c = off[k], on[k]
            rows.append((b, k, a, c, round(c / a, 2) if isinstance(a, (int, float)) and a else "-"))
        a, c = off["itl_p50_ms"], on["itl_p50_ms"]
        rows.append((b, "itl_ms p50", round(a or 0, 1), round(c or 0, 1), round(c / a, 2) if a and c else "-"))
    return "\n".join(f"{r[0]!s:>4} {r[1]:<28} {r[2]!s:>10} {r[3]!s:>10} {r[4]!s:>8}" for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="32,128,256", help="comma list of concurrent requests")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per request (ignore_eos)")
    p.add_argument("--modes", default="threads,aio", help=f"comma list of {', '.join(MODES)}, in order")
    p.add_argument("--model", default="tiny", choices=["tiny", "real"],
                   help=f"tiny: a 2-layer 64-wide {MODEL} with dummy weights (host cost, fast); real: {MODEL}")
    p.add_argument("--repeat", type=int, default=1, help="sweeps of every (B, mode); the figures are medians")
    p.add_argument("--reserve", type=int, default=0, help="D's --num-reserved-decode-tokens (0: its default); "
                   "below --max-tokens, requests grow page by page under --decode-reserve ondemand")
    p.add_argument("--model-dir", default="", help="instead: dummy weights of this config + tokenizer dir "
                   "(e.g. the 8B shape on a GPU)")
    p.add_argument("--up-args", default="", help="more `halfmoon up` flags, one string (e.g. \"--dtype bfloat16 "
                   "--prefill-device cuda:0 --decode-device cuda:0\")")
    p.add_argument("--output", default="", help="JSON path (default: bench/results/decode_host_<time>.json)")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="hm-decode-host-"))
    if args.model_dir:
        model, name = ["--model", args.model_dir, "--load-format", "dummy"], f"{args.model_dir} (dummy weights)"
    elif args.model == "tiny":
        model, name = ["--model", str(tiny_model(tmp)), "--load-format", "dummy"], f"{MODEL} (2 layers, hidden 64, dummy)"
    else:
        model, name = [], MODEL
    model += shlex.split(args.up_args)
    res = {"config": {"batches": batches, "max_tokens": args.max_tokens, "model": name, "up_args": args.up_args,
                      "torch_threads": 1, "load_average": os.getloadavg()}}
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(unknown)} (choose from {', '.join(MODES)})")
    extra = f" --num-reserved-decode-tokens {args.reserve}" if args.reserve else ""
    res["config"]["reserve"] = args.reserve
    res["config"]["repeat"] = args.repeat
    res.update(bench(modes, batches, args.max_tokens, tmp, model, extra, args.repeat))
    if len(modes) > 1:
        print(_table(res, batches, modes[0], modes[-1]))
    write_result(res, "decode_host", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

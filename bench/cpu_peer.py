"""CPU serving side by side: ``halfmoon up`` and (when ``--vllm-python`` is given) vLLM CPU, same
weights, the same ``openai`` streaming client (``halfmoon bench serve --target openai``), interleaved.

    .venv/bin/python -m bench.cpu_peer [--vllm-python /opt/vllm-cpu/bin/python] [--reps 3] [--json out.json]
    .venv/bin/python -m bench.cpu_peer --variant "off=--cpu-share off" --variant "on=--cpu-share on"

``--variant NAME=ARGS`` (repeatable) runs several ``halfmoon up`` stacks instead of one, each with
its extra flags, interleaved like the servers (halfmoon only unless ``--vllm-python``); ``x_<name>``
= that variant's output tokens/s over the first variant's, per repetition, median. Every run
records the 1-minute load average before it (the box may be shared).

Workloads (issue 22's table): ``random`` ~193-token distinct prompts and ``shared-prefix`` one
600-token prefix + 40-token questions; 64 output tokens, EOS ignored; concurrency 1 and 8; 32
requests each. Every repetition runs each (workload, concurrency) on every server, the server
order alternating; both servers stay up (idle) throughout. Figures are medians over repetitions:
output tokens/s, TTFT p50 and TPOT p50 (ms); ``ratio`` = halfmoon / vLLM output tokens/s.

vLLM CPU is not a dependency: install it in its own venv (bench/README.md, "CPU peer"). Without
``--vllm-python`` only halfmoon runs. Processes this script starts are stopped by PID at the end.
JSON on stdout (or ``--json``), a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.results_file import print_result

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {
    "random": ["--workload", "random", "--input-len", "193"],
    "shared-prefix": ["--workload", "shared-prefix", "--groups", "1", "--prefix-len", "600", "--suffix-len", "40"],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 30) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def start_halfmoon(model: str, extra: list[str], tmp: Path, timeout: float = 600) -> tuple[subprocess.Popen, str, str]:
    """``halfmoon up`` (1P1D); returns (process, OpenAI base URL, API key)."""
    ep_file = tmp / "endpoints.json"
    proc = subprocess.Popen([sys.executable, "-m", "halfmoon", "up", "--model", model, "--base-port", "0",
                             "--log-dir", str(tmp / "hm-logs"), "--endpoints-file", str(ep_file), *extra],
                            cwd=ROOT, stdout=open(tmp / "hm-up.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not ep_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc, signal.SIGINT)
            raise RuntimeError(f"halfmoon up did not come up; see {tmp / 'hm-up.log'}")
        time.sleep(0.5)
    ep = json.loads(ep_file.read_text())
    return proc, f"http://{ep['router']['http']}/v1", ep.get("api_key") or "EMPTY"


def start_vllm(python: str, hf_dir: str, name: str, tmp: Path, dtype: str = "float32",
               timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """vLLM CPU's OpenAI server as bench/README.md documents it (``dtype``, default float32; 2 OpenMP
    threads bound to cores 0-1)."""
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1")
    proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir,
                             "--served-model-name", name, "--dtype", dtype, "--max-model-len", "2048",
                             "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=open(tmp / "vllm.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/models", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError(f"vLLM did not come up; see {tmp / 'vllm.log'}") from None
            time.sleep(1)


def run_serve(url: str, key: str, model: str, workload: str, conc: int, args, seed: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "halfmoon", "bench", "serve", "--target", "openai", "--openai-url", url,
           "--api-key", key, "--model", model, "--tokenizer", model, *WORKLOADS[workload],
           "--output-len", str(args.output_len), "--ignore-eos", "--num-requests", str(args.num_requests),
           "--concurrency", str(conc), "--seed", str(seed), "--no-metrics", "--no-progress", "--no-requests",
           "--output", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(out.read_text())["summary"]
    # the mean too: in a closed loop the requests of a burst finish, and so come back, together, and
    # a change that shortens a burst's slowest TTFTs can raise the median while lowering the mean
    return dict(out_tok_s=s["output_tokens_per_s"], ttft_p50_ms=s["ttft_ms"]["p50"], ttft_mean_ms=s["ttft_ms"]["mean"],
                tpot_p50_ms=s["tpot_ms"]["p50"],
                errors=s["errors"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--halfmoon-args", default="", help="extra `halfmoon up` flags, one string")
    ap.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="vLLM's --dtype (pass the same --dtype to halfmoon in --halfmoon-args)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="a halfmoon stack NAME with extra `halfmoon up` flags ARGS (repeatable; default: "
                         "one stack named halfmoon)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bad_variants = [v for v in args.variant if "=" not in v or not v.split("=", 1)[0]
                    or v.split("=", 1)[0] == "vllm-cpu"]
    if bad_variants or len({v.split("=", 1)[0] for v in args.variant}) != len(args.variant):
        ap.error(f"--variant: NAME=ARGS with distinct names other than vllm-cpu, got {args.variant}")
    wls = args.workloads.split(",")
    bad = [w for w in wls if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: unknown {bad}; one of {list(WORKLOADS)}")
    concs = [int(c) for c in args.concurrency.split(",")]
    from engine.model_store import resolve_model

    hf_dir = str(resolve_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="cpu_peer_"))
    procs = []
    try:
        variants = dict(v.split("=", 1) for v in args.variant) if args.variant else {"halfmoon": args.halfmoon_args}
        servers = {}
        for name, extra in variants.items():
            vtmp = tmp / name
            vtmp.mkdir()
            hm, hm_url, hm_key = start_halfmoon(args.model, [*args.halfmoon_args.split(), *extra.split()], vtmp)
            procs.append((hm, signal.SIGINT))
            servers[name] = (hm_url, hm_key)
        if args.vllm_python:
            vp, v_url = start_vllm(args.vllm_python, hf_dir, args.model, tmp, args.vllm_dtype)
            procs.append((vp, signal.SIGTERM))
            servers["vllm-cpu"] = (v_url, "EMPTY")
        names = list(servers)
        runs = {}
        load_before = os.getloadavg()
        for rep in range(args.reps):
            for w in wls:
                for c in concs:
                    for n in (names if rep % 2 == 0 else names[::-1]):
                        url, key = servers[n]
                        load = os.getloadavg()[0]
                        r = run_serve(url, key, args.model, w, c, args, seed=100 + rep, out=tmp / f"{n}_{w}_{c}_{rep}.json")
                        r["load_avg_1m"] = round(load, 2)
                        runs.setdefault((w, c, n), []).append(r)
                        print(f"rep {rep} {w} c={c} {n}: {r['out_tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms "
                              f"(mean {r['ttft_mean_ms']:.0f}), "
                              f"TPOT p50 {r['tpot_p50_ms']:.1f} ms, load {load:.2f}", file=sys.stderr, flush=True)
        table = []
        for w in wls:
            for c in concs:
                row = dict(workload=w, concurrency=c)
                for n in names:
                    rs = runs[(w, c, n)]
                    for k in ("out_tok_s", "ttft_p50_ms", "ttft_mean_ms", "tpot_p50_ms"):
                        row[f"{n}_{k}"] = round(statistics.median(r[k] for r in rs), 1)
                    row[f"{n}_errors"] = sum(r["errors"] for r in rs)
                    row[f"{n}_load_avg_1m"] = [r["load_avg_1m"] for r in rs]
                first = runs[(w, c, names[0])]
                for n in list(variants)[1:]:  # same repetition, so the same load on both
                    row[f"x_{n}"] = round(statistics.median(
                        b["out_tok_s"] / a["out_tok_s"] for a, b in zip(first, runs[(w, c, n)])), 2)
                if "vllm-cpu" in servers:
                    row["ratio"] = round(row[f"{names[0]}_out_tok_s"] / row["vllm-cpu_out_tok_s"], 2)
                table.append(row)
        out = dict(bench="cpu_peer", model=args.model, servers=names, reps=args.reps, num_requests=args.num_requests,
                   output_len=args.output_len, halfmoon_args=args.halfmoon_args, variants=variants,
                   vllm_dtype=args.vllm_dtype if args.vllm_python else None,
                   cpus=os.cpu_count(),
                   load_avg_before=load_before, load_avg_after=os.getloadavg(), table=table,
                   runs=[dict(workload=w, concurrency=c, server=n, reps=v) for (w, c, n), v in runs.items()])
    finally:
        for p, sig in reversed(procs):
            _stop(p, sig)
    print_result(out, args.json)
    for row in table:
        print("  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    print(f"load average before {out['load_avg_before']}, after {out['load_avg_after']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

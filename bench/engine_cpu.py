"""Engine CPU benchmark: prefill and decode throughput of halfmoon's co-located engine next to
Hugging Face ``transformers`` ``generate`` on the same weights, fp32 and bf16, in one run.

    .venv/bin/python -m bench.engine_cpu [--threads 2] [--dtypes float32,bfloat16] [--json out.json]

Metrics (tokens/s, higher is better; median of ``--repeats``):

* ``prefill``: one 512-token prompt (random ids), batch 1: prompt tokens / time to the first token.
  halfmoon: one extend step (radix cache off, so nothing is reused); transformers: ``generate``
  with ``max_new_tokens=1``.
* ``decode`` at batch 1 and 8: 32-token prompts, ``--decode-tokens`` new tokens each (EOS ignored);
  tokens/s = batch * (new tokens - 1) / (total time - time of the first token).

Both engines stay loaded and each repetition alternates which runs first (the box is shared, and
load from other processes would otherwise favour whichever ran in a quieter minute).
The JSON (stdout, or ``--json``) has every measurement, the ratio halfmoon / transformers per row,
and the machine's load average before and after (other processes share this box; read figures
with that in mind). A table goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from bench.results_file import print_result


def _rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


class HalfmoonRunner:
    def __init__(self, model: str, dtype: str, max_batch: int):
        from engine.engine import Engine

        self.eng = Engine(model, dtype=dtype, page_size=16, num_pages=1024, max_running_requests=max_batch,
                          max_context=2048, disable_radix_cache=True, chunked_prefill_size=4096)
        self.vocab = self.eng.model_config.vocab_size

    def first_token_time(self, prompts: list[list[int]]) -> float:
        from engine.sampling_params import SamplingParams

        p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        self.eng.generate(prompts, p)
        return time.perf_counter() - t

    def generate_time(self, prompts: list[list[int]], new_tokens: int) -> float:
        from engine.sampling_params import SamplingParams

        p = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        outs = self.eng.generate(prompts, p)
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return time.perf_counter() - t


class TransformersRunner:
    def __init__(self, path, dtype: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
        self.vocab = self.model.config.vocab_size

    def _gen(self, prompts, n):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n

    def first_token_time(self, prompts):
        t = time.perf_counter()
        self._gen(prompts, 1)
        return time.perf_counter() - t

    def generate_time(self, prompts, new_tokens):
        t = time.perf_counter()
        self._gen(prompts, new_tokens)
        return time.perf_counter() - t


def measure(runners: dict, args) -> list[dict]:
    """Both engines loaded; each repetition runs the same prompts on one engine, then the other
    (alternating which goes first), so load from other processes hits both alike."""
    vocab = next(iter(runners.values())).vocab
    seed = [0]

    def fresh(n, b):
        seed[0] += 1
        return [_rand_ids(n, vocab, seed[0] * 100 + i) for i in range(b)]

    def order(rep):
        names = list(runners)
        return names if rep % 2 == 0 else names[::-1]

    warm = fresh(16, 1)
    for r in runners.values():
        r.first_token_time(warm)
    rows = []
    ttft = {n: [] for n in runners}
    for rep in range(args.repeats):
        prompts = fresh(args.prompt_len, 1)
        for n in order(rep):
            ttft[n].append(runners[n].first_token_time(prompts))
    for n in runners:
        t = statistics.median(ttft[n])
        rows.append(dict(engine=n, metric="prefill", batch=1, tokens_per_s=args.prompt_len / t, seconds=t,
                         prompt_len=args.prompt_len))
    for b in (1, 8):
        k = args.decode_tokens
        first = {n: [] for n in runners}
        total = {n: [] for n in runners}
        for rep in range(args.repeats):
            prompts = fresh(32, b)
            for n in order(rep):
                first[n].append(runners[n].first_token_time(prompts))
                total[n].append(runners[n].generate_time(prompts, k))
        for n in runners:
            dt = statistics.median(total[n]) - statistics.median(first[n])
            rows.append(dict(engine=n, metric="decode", batch=b, tokens_per_s=b * (k - 1) / dt, seconds=dt,
                             new_tokens=k))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.model_store import resolve_model

    path = resolve_model(args.model)
    load_before = os.getloadavg()
    results = []
    for dtype in args.dtypes.split(","):
        runners = {"halfmoon": HalfmoonRunner(str(path), dtype, 8), "transformers": TransformersRunner(path, dtype)}
        for r in measure(runners, args):
            results.append(dict(dtype=dtype, **r))
            print(f"[{r['engine']} {dtype}] {r['metric']} batch {r['batch']}: {r['tokens_per_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
        del runners
    table = []
    for r in results:
        if r["engine"] != "halfmoon":
            continue
        peer = next(x for x in results if x["engine"] == "transformers" and x["dtype"] == r["dtype"]
                    and x["metric"] == r["metric"] and x["batch"] == r["batch"])
        table.append(dict(dtype=r["dtype"], metric=r["metric"], batch=r["batch"],
                          halfmoon_tok_s=round(r["tokens_per_s"], 1), transformers_tok_s=round(peer["tokens_per_s"], 1),
                          ratio=round(r["tokens_per_s"] / peer["tokens_per_s"], 2)))
    out = dict(bench="engine_cpu", model=args.model, threads=args.threads, torch=torch.__version__,
               machine=platform.machine(), cpus=os.cpu_count(), prompt_len=args.prompt_len,
               decode_tokens=args.decode_tokens, repeats=args.repeats,
               load_avg_before=load_before, load_avg_after=os.getloadavg(),
               results=results, table=table,
               note="ratio = halfmoon / transformers tokens/s; the box is shared, see load_avg")
    print_result(out, args.json)
    hdr = f"{'dtype':9} {'metric':8} {'batch':>5} {'halfmoon tok/s':>15} {'transformers tok/s':>19} {'ratio':>6}"
    print(hdr, file=sys.stderr)
    for t in table:
        print(f"{t['dtype']:9} {t['metric']:8} {t['batch']:>5} {t['halfmoon_tok_s']:>15} "
              f"{t['transformers_tok_s']:>19} {t['ratio']:>6}", file=sys.stderr)
    print(f"load average before {load_before}, after {out['load_avg_after']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

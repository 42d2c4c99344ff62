"""Decode stream cost benchmark: CPU per token of D's Generate stream path, coalesced or not.

    PYTHONPATH=. python -m bench.decode_streams [--batches 32,128,256] [--tokens 64] [--step-ms 5] \\
        [--output bench/results/decode_streams_cpu.json]

D's real stream path in isolation: a sync ``grpc.server`` (one thread per stream, as D serves
``Generate``) whose handler is ``decode_svc.stream_chunks`` over a per-stream queue, B streams read
by a real ``grpc.aio`` client in another process. A producer thread plays the decode scheduler: each
step it puts one per-token ``DecodeChunk`` on every stream's queue, then sleeps ``--step-ms`` (a GPU
step, during which the GIL is free). Reports the server process's CPU µs per delivered token
(stream threads + gRPC; the producer's own puts included), the wall time of the run, and the chunks
per token the client received, for ``coalesce`` off (one message per token: the old path) and on,
with the on/off ratio. The served step's host work on the H200 (GPU_NOTES session 4: ~170 µs per
running request per step at B≈256) is this cost paid under the GIL the scheduler thread needs.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from bench.results_file import write_result
from decode_svc import stream_chunks
from protos import decode_pb2, decode_pb2_grpc

_CLIENT = """
import asyncio, sys
import grpc
from protos import decode_pb2, decode_pb2_grpc

async def one(stub, room):
    toks = chunks = 0
    async for c in stub.Generate(decode_pb2.DecodeRequest(room=room)):
        toks, chunks = toks + len(c.token_ids), chunks + 1
    return toks, chunks

async def main(addr, n):
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = decode_pb2_grpc.DecodeStub(ch)
        r = await asyncio.gather(*(one(stub, i + 1) for i in range(n)))
    print(sum(t for t, _ in r), sum(c for _, c in r))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


class _Streams(decode_pb2_grpc.DecodeServicer):
    def __init__(self, coalesce: bool):
        self.coalesce = coalesce
        self.queues: dict[int, queue.SimpleQueue] = {}
        self.opened = threading.Semaphore(0)

    def Generate(self, request, context):
        q = self.queues[request.room] = queue.SimpleQueue()
        self.opened.release()
        yield from stream_chunks(q, keepalive_s=0, queued=lambda: False, coalesce=self.coalesce)


def run(b: int, tokens: int, step_s: float, coalesce: bool) -> dict:
    """One run: ``b`` streams of ``tokens`` tokens each, one token per stream per step."""
    svc = _Streams(coalesce)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=b + 8))
    decode_pb2_grpc.add_DecodeServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, f"127.0.0.1:{port}", str(b)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(b):
            if not svc.opened.acquire(timeout=60):
                raise RuntimeError("streams did not open")
        qs = list(svc.queues.values())
        cpu0, t0 = time.process_time(), time.perf_counter()
        for s in range(tokens):
            last = s == tokens - 1
            for q in qs:
                q.put(decode_pb2.DecodeChunk(token_ids=[s], finish_reason="length" if last else ""))
                if last:
                    q.put(None)
            time.sleep(step_s)
        out, _ = client.communicate(timeout=600)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        if client.poll() is None:
            client.kill()
        server.stop(0)
    got, chunks = (int(x) for x in out.split())
    return {"streams": b, "tokens": got, "server_cpu_us_per_token": round(1e6 * cpu / got, 1),
            "wall_s": round(wall, 2), "ideal_wall_s": round(tokens * step_s, 2),
            "chunks_per_token": round(chunks / got, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="32,128,256")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=5.0, help="producer sleep per step (a GPU step)")
    p.add_argument("--output", default="")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    res = {"config": {"batches": batches, "tokens": args.tokens, "step_ms": args.step_ms,
                      "cpus": os.cpu_count(), "load_average": os.getloadavg()}, "off": {}, "on": {}}
    for b in batches:
        for mode in ("off", "on"):  # alternating: a shared machine's load drifts over both alike
            res[mode][str(b)] = run(b, args.tokens, args.step_ms / 1000, mode == "on")
            print(json.dumps({mode: res[mode][str(b)]}), flush=True)
    rows = [("B", "metric", "off", "on", "on/off")]
    for b in batches:
        off, on = res["off"][str(b)], res["on"][str(b)]
        for k in ("server_cpu_us_per_token", "wall_s", "chunks_per_token"):
            rows.append((b, k, off[k], on[k], round(on[k] / off[k], 2) if off[k] else "-"))
        rows.append((b, "ideal_wall_s", off["ideal_wall_s"], on["ideal_wall_s"], ""))
    print("\n".join(f"{r[0]!s:>4} {r[1]:<26} {r[2]!s:>9} {r[3]!s:>9} {r[4]!s:>7}" for r in rows))
    write_result(res, "decode_streams", args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())

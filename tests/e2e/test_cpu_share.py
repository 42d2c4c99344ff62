"""CPU core sharing end to end (``halfmoon up --cpu-share on``; engine/cpu_share.py):
on one machine, the decode worker decodes on every core while the prefill worker is idle, gives
cores back while a prefill runs and takes them again after; the prefill worker prefills on every
core while decode is idle. Watched in the stack's share file (every record, polled each
millisecond) and on both workers' ``/metrics`` gauges. Greedy tokens through all those thread
changes equal the co-located engine's on one thread. A bad ``--cpu-share`` stops a worker with
one line naming the flag, before the model loads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from engine.cpu_share import CpuShare
from tests.e2e.conftest import greedy, reference_ids, stack_fixture

ROOT = Path(__file__).resolve().parents[2]

# the share file alone decides (no idle-core test): the threads must move whatever else loads the box
_FILE_ONLY = ["--cpu-share-min-idle", "0"]
stack = stack_fixture(prefill=1, decode=1, cpu_share=True, role_args={"prefill": _FILE_ONLY, "decode": _FILE_ONLY})

STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who every morning "
         "mended his nets and told stories to the children of the harbour.")
STORY_TOKENS = 240  # a few seconds of decoding on 2 threads (~15 ms a token): outlasts a 1000-token prefill


def _long_prompt(tok, topic: str) -> list[int]:
    """1000 tokens: two 512-token prefill chunks (the stack's 64 MiB pools hold 91 pages)."""
    text = f"Notes on {topic}. " + " ".join(f"Entry {i}: the {topic} log records a calm sea and a steady light."
                                             for i in range(110))
    return tok.encode(text)[:1000]


class Watcher:
    """Samples (P busy, P threads, D busy, D threads) from the share file every millisecond."""

    def __init__(self, path: str, pids: dict[str, int]):
        self.path = path
        self.pids = pids
        self.samples: list[tuple[float, bool, int, bool, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            _, recs = CpuShare.read(self.path)
            by = {r.pid: r for r in recs}
            p, d = by[self.pids["prefill"]], by[self.pids["decode"]]
            s = (time.monotonic(), p.busy, p.threads, d.busy, d.threads)
            if not self.samples or self.samples[-1][1:] != s[1:]:
                self.samples.append(s)
            time.sleep(0.001)

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def seen(self, since: float, p_busy=None, p_threads=None, d_busy=None, d_threads=None) -> bool:
        for t, pb, pt, db, dt in self.samples:
            if t >= since and all(want is None or got == want for want, got in
                                  ((p_busy, pb), (p_threads, pt), (d_busy, db), (d_threads, dt))):
                return True
        return False

    def wait_for(self, timeout: float, **want) -> None:
        since, end = time.monotonic(), time.monotonic() + timeout
        while time.monotonic() < end:
            if self.seen(since - 0.5, **want):
                return
            time.sleep(0.005)
        raise AssertionError(f"share file never showed {want}; samples {self.samples[-20:]}")


def _gauge(worker: dict, name: str) -> float:
    text = urllib.request.urlopen(f"http://{worker['metrics']}/metrics", timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_threads_follow_the_other_workers_load(stack, stub, tok):
    from protos import router_pb2

    ep = stack.endpoints
    assert ep["cpu_share"], "halfmoon up made no share file"
    cores = CpuShare.read(ep["cpu_share"])[0]
    if cores < 2:
        pytest.skip("one core: nothing to share")
    pids = {role: ep[role][0]["pid"] for role in ("prefill", "decode")}
    story = tok.encode(STORY)
    ref = reference_ids([story], STORY_TOKENS)[0]
    assert len(ref) == STORY_TOKENS, "the story must decode long enough to overlap a prefill"
    with Watcher(ep["cpu_share"], pids) as w:
        # D idle: P prefills on every core
        list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=_long_prompt(tok, "harbour")),
                                                      sampling=greedy(1)), timeout=120))
        assert w.seen(0, p_busy=True, p_threads=cores), w.samples
        assert _gauge(ep["prefill"][0], "halfmoon_prefill_torch_threads") == cores
        out: list[int] = []
        stream = threading.Thread(target=lambda: out.extend(
            t for r in stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=story),
                                                                sampling=greedy(STORY_TOKENS)), timeout=300)
            for t in r.token_ids))
        stream.start()
        # P idle: D decodes on every core
        w.wait_for(60, p_busy=False, d_busy=True, d_threads=cores)
        assert _gauge(ep["decode"][0], "halfmoon_decode_torch_threads") == cores
        # a prefill while D decodes: both on their share, then D takes the cores back
        t_long = time.monotonic()
        list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=_long_prompt(tok, "lighthouse")),
                                                      sampling=greedy(1)), timeout=120))
        assert w.seen(t_long, p_busy=True, p_threads=max(1, cores // 2), d_busy=True,
                      d_threads=max(1, cores // 2)), w.samples
        assert stream.is_alive(), "the story ended before the prefill: no overlap was tested"
        w.wait_for(30, p_busy=False, d_busy=True, d_threads=cores)
        stream.join(timeout=300)
    assert out == ref  # greedy tokens unchanged by the thread changes
    assert _gauge(ep["prefill"][0], "halfmoon_prefill_torch_threads") == max(1, cores // 2)


@pytest.mark.parametrize("args, why", [
    (["--cpu-share", "{full}"], "--cpu-share: {full}: all 1 records belong to live processes"),
    (["--cpu-share", "/nonexistent/share", "--tp", "2"], "--cpu-share: needs --device cpu and --tp 1"),
])
def test_bad_cpu_share_stops_the_worker_with_one_line(tmp_path, args, why):
    full = CpuShare.create(tmp_path / "full", cores=2, records=1)
    holder = CpuShare.open(full, 1, apply=lambda n: None)  # this test process holds the one record
    args = [a.format(full=full) for a in args]
    try:
        proc = subprocess.run([sys.executable, "-m", "halfmoon", "serve-decode", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert proc.returncode != 0
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {why.format(full=full)}"), lines
    assert "Traceback" not in proc.stderr

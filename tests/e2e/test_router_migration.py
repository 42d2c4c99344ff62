"""Stream migration and graceful drain end to end (real processes, real UCX, the real ``openai``
client): a 1P2D stack behind a router with ``--migration-limit 1``; each test starts with two live
decode workers (a spare replaces every one a test stops).

- a decode worker SIGKILLed mid-stream: the gRPC stream and the OpenAI SSE stream go on on the
  other pair and equal the uninterrupted run (tokens, text, usage counted once);
- SIGTERM to a decode worker under 16 concurrent streams: all 16 complete equal to their
  uninterrupted runs, the streams left at the end of ``--drain-grace-s`` migrate, and the worker
  exits within the grace period;
- a second kill of the same stream, beyond the limit: UNAVAILABLE naming ``--migration-limit``
  (last: it leaves no decode worker).
After each test every surviving worker's KV accounting is idle and clean.
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.conftest import (MODEL, assert_clean_log, assert_idle_accounting, model_available,
                                        start_router, start_stack, start_worker, wait_ready)

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

GRACE_S = 1.5
DECODE_FLAGS = ["--drain-grace-s", str(GRACE_S)]
LONG = 40  # tokens of a stream that is killed mid-way


class Cluster:
    """The module's stack, its router and the decode workers started so far (id -> Proc)."""

    def __init__(self, st, router, http: str) -> None:
        self.st, self.router, self.http = st, router, http
        self.decodes = dict(st.decodes)

    def live(self) -> list:
        return [p for p in self.decodes.values() if p.popen.poll() is None]

    def spare(self) -> None:
        """Start one more decode worker (in the background; :meth:`ready` waits for it)."""
        wid = f"decode-{len(self.decodes)}"
        p = start_worker("decode", self.st.registry.address, self.st.log_dir, wid, extra=DECODE_FLAGS, wait=False)
        self.st.procs.append(p)   # the stack stops it
        self.decodes[wid] = p

    def ready(self) -> None:
        """Two live decode workers, both healthy in the router's pool."""
        for p in self.live():
            if not p.address:
                wait_ready(p)
        assert len(self.live()) == 2
        addrs = {self.st.prefill.address} | {p.address for p in self.live()}
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(self.router.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            while {w.address for w in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
                   if w.healthy} != addrs:
                assert time.monotonic() < deadline, self.router.log()[-3000:]
                time.sleep(0.1)

    def serving_decode(self, stub) -> str:
        """The decode worker the router has a request on now."""
        ws = [w for w in stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers
              if w.role == "decode" and w.inflight > 0]
        assert len(ws) == 1, ws
        return ws[0].worker_id

    def assert_idle(self) -> None:
        started = [p for p in self.live() if p.address]   # a spare still loading holds nothing
        assert_idle_accounting([("prefill", self.st.prefill.address)] + [("decode", p.address) for p in started])
        assert_clean_log(self.router)
        assert_clean_log(self.st.prefill)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("migrate")
    with start_stack(log_dir, decode_extra=DECODE_FLAGS, more_decodes={"decode-1": DECODE_FLAGS}) as st:
        router = start_router(log_dir, registry=st.registry.address, extra=["--migration-limit", "1"])
        st.procs.append(router)
        http = router.wait_line(r"READY router grpc=\S+ http=(\S+)").group(1)
        yield Cluster(st, router, http)


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.router.address) as ch:
        yield router_pb2_grpc.RouterStub(ch)


@pytest.fixture(autouse=True)
def two_decodes(cluster):
    cluster.ready()
    yield
    cluster.assert_idle()


def _request(ids, max_tokens=LONG):
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def _tokens(resps) -> list[int]:
    return [t for r in resps for t in r.token_ids]


def _stream(stub, ids, max_tokens=LONG, on_token=None) -> list:
    """Read a whole gRPC stream; ``on_token(n, resp)`` after each response with tokens."""
    out = []
    for r in stub.Generate(_request(ids, max_tokens), timeout=180):
        out.append(r)
        if on_token and r.token_ids:
            on_token(len(_tokens(out)), r)
    return out


def test_sigkill_mid_stream_grpc_continues_equal_to_uninterrupted(cluster, stub, tok):
    ids = tok.encode("The old lighthouse keeper climbed the spiral stairs every evening and")
    ref = _stream(stub, ids)
    killed = []

    def kill_at_3(n, r):
        if n >= 3 and not killed:
            killed.append(r.decode_worker)
            cluster.decodes[r.decode_worker].kill()

    got = _stream(stub, ids, on_token=kill_at_3)
    cluster.spare()
    assert killed and got[-1].decode_worker != killed[0]   # the stream really moved
    assert _tokens(got) == _tokens(ref) and len(_tokens(got)) == LONG
    assert "".join(r.text for r in got) == "".join(r.text for r in ref)
    u, ref_u = got[-1].usage, ref[-1].usage
    assert got[-1].finish_reason == "length" and u.migrations == 1 and ref_u.migrations == 0
    assert u.prompt_tokens == ref_u.prompt_tokens == len(ids) and u.completion_tokens == LONG
    assert 0 <= u.cached_tokens <= u.prompt_tokens


def test_sigkill_mid_stream_openai_sse_continues_equal_to_uninterrupted(cluster, stub):
    import openai

    client = openai.OpenAI(base_url=f"http://{cluster.http}/v1", api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea and its ships."}],
              max_tokens=LONG, temperature=0, stream=True, stream_options={"include_usage": True},
              extra_body={"ignore_eos": True})

    killed = []

    def read(kill_after=None):
        text, usage, finish, n = "", None, None, 0
        for ch in client.chat.completions.create(**kw):
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
                n += 1
                if n == kill_after:
                    killed.append(cluster.serving_decode(stub))
                    cluster.decodes[killed[0]].kill()
        return text, usage, finish

    ref_text, ref_usage, ref_finish = read()
    text, usage, finish = read(kill_after=3)
    cluster.spare()
    assert killed and cluster.decodes[killed[0]].popen.poll() is not None   # killed mid-stream
    assert (text, finish) == (ref_text, ref_finish) and finish == "length"
    assert usage.completion_tokens == ref_usage.completion_tokens == LONG
    assert usage.prompt_tokens == ref_usage.prompt_tokens


def test_sigterm_under_16_streams_all_complete_and_worker_exits_within_grace(cluster, stub, tok):
    unique = [tok.encode(f"Story {i}: the {w} walked along the quiet shore and") for i, w in enumerate(
        ["sailor", "child", "keeper", "painter", "fisherman", "baker", "smith", "weaver"])]
    prompts = unique * 2                                      # 16 streams, each prompt twice
    lengths = [8 if i % 4 == 0 else 64 for i in range(16)]   # a few finish inside the grace
    with ThreadPoolExecutor(16) as ex:
        once = list(ex.map(lambda a: _tokens(_stream(stub, *a)), zip(unique, lengths[:8])))
        refs = once * 2
        started = [0] * 16
        futs = [ex.submit(_stream, stub, p, n, lambda k, r, i=i: started.__setitem__(i, k))
                for i, (p, n) in enumerate(zip(prompts, lengths))]
        deadline = time.monotonic() + 120
        while not all(started):                       # every stream has its first token
            assert time.monotonic() < deadline and not any(f.done() and f.exception() for f in futs)
            time.sleep(0.05)
        inflight = {w.worker_id: w.inflight for w in stub.ListWorkers(router_pb2.ListWorkersRequest()).workers
                    if w.role == "decode"}
        victim_id = max(inflight, key=inflight.get)
        victim = cluster.decodes[victim_id]
        t0 = time.monotonic()
        victim.popen.terminate()
        late = ex.submit(_stream, stub, prompts[1], 8)  # a new request meanwhile: the other one serves it
        victim.popen.wait(GRACE_S + 15)
        exit_s = time.monotonic() - t0
        outs = [f.result(timeout=180) for f in futs]
        late = _tokens(late.result(timeout=180))
    cluster.spare()
    assert [_tokens(o) for o in outs] == refs
    assert late == refs[1][:8]
    moved = [o for o in outs if len({r.decode_worker for r in o}) > 1]
    assert moved and all(o[0].decode_worker == victim_id and o[-1].usage.migrations == 1 for o in moved)
    assert all(o[-1].usage.completion_tokens == n for o, n in zip(outs, lengths))
    # running streams get --drain-grace-s, then the rest are handed back at once (the worker's own
    # clock) ...
    log = victim.log()
    stamps = {what: datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for what in ("draining:", "drained")
              for m in [re.search(r"^(\S+ \S+) .*" + what, log, flags=re.M)] if m}
    assert len(stamps) == 2 and "handed back to the router" in log, log[-3000:]
    assert GRACE_S <= (stamps["drained"] - stamps["draining:"]).total_seconds() < GRACE_S + 3, stamps
    # ... and the process is gone inside the grace period the Helm chart gives a pod
    # (terminationGracePeriodSeconds >= drainGraceSeconds + 20; a loaded 2-core box is slow to stop)
    assert exit_s < GRACE_S + 20, exit_s
    assert victim.popen.returncode == 0


def test_second_kill_beyond_the_limit_ends_unavailable_naming_it(cluster, stub, tok):
    ids = tok.encode("A long list of the harbour's ships, one per line:")
    kills = []

    def kill_each_pair(n, r):
        if n in (3, 8) and len(kills) < 2 and r.decode_worker not in kills:
            kills.append(r.decode_worker)
            cluster.decodes[r.decode_worker].kill()

    with pytest.raises(grpc.RpcError) as ei:
        _stream(stub, ids, on_token=kill_each_pair)
    # the module's last test: no spare replaces them
    assert len(kills) == 2 and kills[0] != kills[1]
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "--migration-limit 1 reached" in ei.value.details() and kills[1] in ei.value.details()

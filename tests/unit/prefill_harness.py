"""Test harness: PrefillScheduler in one process (a real tiny random-weight ModelRunner on P, D's KV
pools behind the in-process fake transport ``tests/fakes/transfer.py``), driven by the test
playing D: its destinations, the notices it receives, the bytes that landed, exact accounting.
Used by tests/unit/test_prefill_scheduler.py and test_prefill_fencing.py.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from engine.config import CONFIGS_DIR, EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kvcache.kv_pool import KVPool
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from pd_common.protocol import ServiceError, kv_layout
from prefill_svc.jobs import Destination, JobState, PrefillJob
from prefill_svc.kv_runs import PoolGeometry
from prefill_svc.scheduler import PrefillScheduler
from protos import prefill_pb2
from tests.fakes.transfer import FakeFabric

PS = 4
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 2-layer random model (load_format="dummy"), shared by every test's runner."""
    d = tmp_path_factory.mktemp("tiny")
    cfg = json.loads((CONFIGS_DIR / "smollm2-135m.json").read_text())
    cfg.update(TINY)
    (d / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(_config(str(d)))
    return runner.model, str(d)


def _config(model_dir: str, **kw) -> EngineConfig:
    kw = dict(dict(page_size=PS, num_pages=48, max_running_requests=4, chunked_prefill_size=64), **kw)
    return EngineConfig(model=model_dir, load_format="dummy", max_context=256, torch_threads=1, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 250 + 3 for i in range(n)]


class Pair:
    """P's scheduler over a fresh pool, and decode pools registered with the fake transport."""

    def __init__(self, model, tmp_path, *, dest_timeout_s: float = 30.0, checksums: bool = False,
                 **config):
        self.weights, self.model_dir = model
        self.runner = ModelRunner(_config(self.model_dir, **config), loaded=(self.weights, None))
        self.fabric = FakeFabric()
        self.p = self.fabric.engine("prefill-0")
        self.p.register_pool(self.runner.kv_pool)
        self.d_pool, self.d = self.add_decode("decode-0")
        self._free = {"decode-0": random.Random(0).sample(range(self.d_pool.num_pages), self.d_pool.num_pages)}
        self.log_path = tmp_path / "transfer.jsonl"
        self.sched = PrefillScheduler(self.runner, self.p, destination_timeout_s=dest_timeout_s,
                                      transfer_log=str(self.log_path), checksums=checksums)
        self.sched.start()

    def add_decode(self, name: str, *, page_size: int = PS, layout: str = "page_major"):
        mc = self.runner.model_config
        pool = KVPool(32, page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.runner.dtype,
                      layout=layout)
        eng = self.fabric.engine(name)
        eng.register_pool(pool)
        eng.publish(kv_layout(pool, self.model_dir))
        return pool, eng

    # ------------------------------------------------------------------ driving
    def submit(self, ids, room: int, **params) -> PrefillJob:
        params.setdefault("temperature", 0.0)
        job = PrefillJob(request_id=f"r{room}", room=room, prompt_ids=list(ids),
                         params=SamplingParams(max_tokens=4, **params))
        self.sched.submit(job)
        return job

    def destination(self, room: int, n: int, pre_len: int = 0, *, segment: str = "decode-0",
                    pages: list[int] | None = None, **msg) -> Destination:
        """D's destination for a prompt of ``n`` tokens with D's prefix hit ``pre_len``: fresh,
        scattered destination pages (the delta's count unless ``pages``), built like the server does."""
        if pages is None:
            k = -(-n // PS) - pre_len // PS
            pages, self._free[segment] = self._free[segment][:k], self._free[segment][k:]
        seg = self.sched.open_segment(segment)
        m = prefill_pb2.KVDestination(**{**dict(room=room, decode_segment=segment, dst_page_ids=pages,
                                                pre_len=pre_len, prompt_len=n), **msg})
        return Destination(m, seg, PoolGeometry.from_layout(seg.kv_layout))

    def offer(self, dest: Destination) -> None:
        assert self.sched.offer_destination(dest) is None

    def notices(self, want: int = 1, timeout: float = 10.0) -> list[prefill_pb2.KVNotice]:
        """The next ``want`` notices D received (waits up to ``timeout`` seconds)."""
        out, deadline = [], time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            out += [prefill_pb2.KVNotice.FromString(n.payload) for n in self.d.wait_notify(0.05)]
        assert len(out) >= want, out
        return out

    def no_more_notices(self, wait: float = 0.2) -> None:
        assert self.d.wait_notify(wait) == []

    def batches(self, room: int) -> list[dict]:
        return [r for r in self.records() if r["event"] == "batch" and r["room"] == room]

    def records(self) -> list[dict]:
        return [json.loads(x) for x in self.log_path.read_text().splitlines()] if self.log_path.exists() else []

    def wait_state(self, room: int, state: JobState, timeout: float = 10.0) -> None:
        assert wait_until(lambda: getattr(self.sched.jobs.get(room), "state", None) is state, timeout), \
            self.sched.jobs.get(room)

    # ------------------------------------------------------------------ checks
    def assert_idle_accounting(self):
        assert wait_until(lambda: (a := self.sched.load().accounting).held_rooms == 0
                          and a.held_req_slots == 0)
        a = self.sched.load().accounting
        assert a.free_pages + a.evictable_pages + a.locked_pages + a.owned_pages == a.total_pages, a
        assert a.locked_pages == a.min_lock_ref == a.owned_pages == 0, a
        assert a.held_rooms == a.held_req_slots == 0, a
        return a

    def assert_pages_landed(self, room: int, dest: Destination) -> list[int]:
        """Every batch's source pages on P equal its destination pages on D, byte for byte; returns
        the logical pages sent, in order."""
        sent = []
        for rec in self.batches(room):
            src, dst = torch.tensor(rec["src_pages"]), torch.tensor(rec["dst_pages"])
            assert rec["dst_pages"] == list(dest.msg.dst_page_ids[len(sent): len(sent) + len(src)])
            for layer in range(self.d_pool.num_layers):
                p, d = self.runner.kv_pool, self.d_pool
                assert torch.equal(p.k_pages(layer)[src], d.k_pages(layer)[dst])
                assert torch.equal(p.v_pages(layer)[src], d.v_pages(layer)[dst])
            sent += rec["logical_pages"]
        return sent

    def reference(self, ids) -> tuple[list[torch.Tensor], int]:
        """(per layer [K, V] of every position, each [len, kv_heads, head_dim]; greedy first token)
        from a fresh runner computing the whole prompt at once."""
        r = ModelRunner(_config(self.model_dir), loaded=(self.weights, None))
        row = r.req_to_token_pool.alloc()
        slots = r.allocator.alloc_slots(0, len(ids), None)
        r.req_to_token_pool.write(row, 0, slots)
        logits = r.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [list(ids)], slots, r.device))
        kv = [t for layer in range(r.kv_pool.num_layers) for t in r.kv_pool.read(layer, slots)]
        return kv, int(logits[0].argmax())

    def assert_kv_is(self, dest: Destination, ids) -> int:
        """D's destination pages hold the prompt's K/V from D's pre_len on; returns the reference
        greedy first token."""
        kv, first = self.reference(ids)
        pre = int(dest.msg.pre_len)
        pos = torch.arange(pre, len(ids))
        dst = torch.tensor(list(dest.msg.dst_page_ids))
        d_slots = dst[(pos - pre) // PS] * PS + pos % PS
        got = [t for layer in range(self.d_pool.num_layers) for t in self.d_pool.read(layer, d_slots)]
        for g, want in zip(got, kv, strict=True):
            torch.testing.assert_close(g, want[pre:], atol=1e-5, rtol=1e-4)
        return first

    def close(self) -> None:
        self.fabric.release_held()
        self.sched.stop()


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return False


def error_of(job: PrefillJob, timeout: float = 10.0) -> ServiceError:
    with pytest.raises(ServiceError) as e:
        job.reply.result(timeout)
    return e.value


@pytest.fixture
def pair(model, tmp_path):
    made = []

    def make(**kw) -> Pair:
        made.append(Pair(model, tmp_path, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()

"""Transfer engine between real processes on loopback, over UCX shared memory (`sm`) and `tcp`.

The test process hosts one TransferEngine; peers are `python -m tests.integration.transfer_peer`
children.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time

import numpy as np
import pytest

from telemetry import metrics
from tests.integration.transfer_peer import PeerProcess, fill_bytes
from transfer_svc import BoundsError, DescriptorError, Op, SegmentClosed, State, TransferEngine

MiB = 1 << 20
CHUNK = 128 * 1024
REGION = 128 * MiB
TRANSPORTS = ["sm", "tcp"]


@pytest.fixture(params=TRANSPORTS)
def tl(request):
    return request.param


@pytest.fixture
def peers():
    started: list[PeerProcess] = []

    def start(name, transports, size=REGION, **kw):
        kw.setdefault("timeout_s", 60.0)
        p = PeerProcess(name, size=size, transports=transports, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture
def engine_factory():
    made: list[TransferEngine] = []

    def make(name, transports, **kw):
        kw.setdefault("timeout_s", 60.0)  # generous: the box may be loaded; failure tests set less
        e = TransferEngine(name, transports=transports, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _buffer(nbytes: int, seed: int | None = None) -> np.ndarray:
    buf = np.zeros(nbytes, dtype=np.uint8)
    if seed is not None:
        fill_bytes(buf, seed)
    return buf


def run_in_threads(fn, n: int) -> None:
    """Call ``fn(k)`` for k in 0..n-1, each in its own thread; fail (listing them) if any of them raised."""
    errors = []

    def guarded(k: int) -> None:
        try:
            fn(k)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_scattered_writes_into_permuted_layout(tl, peers, engine_factory):
    """512 scattered 128 KiB writes, source chunks and destination slots both permuted, byte-exact."""
    eng = engine_factory("writer", tl)
    src = _buffer(REGION, seed=1)
    eng.register_memory(src.ctypes.data, src.nbytes)
    peer = peers("target", tl)
    seg = eng.open_segment(peer.descriptor)
    reg = metrics.build_registry(groups=["transfer"])
    bytes_before = reg.get_sample_value("halfmoon_transfer_bytes_total")
    batches_before = reg.get_sample_value("halfmoon_transfer_batch_seconds_count")
    rng = np.random.default_rng(7)
    src_slots = rng.permutation(REGION // CHUNK)[:512]
    dst_slots = rng.permutation(REGION // CHUNK)[:512]
    descs = [(src.ctypes.data + int(s) * CHUNK, peer.base + int(d) * CHUNK, CHUNK)
             for s, d in zip(src_slots, dst_slots)]
    bid = eng.submit(seg, descs, Op.WRITE)
    st = eng.wait(bid)
    assert st.state is State.COMPLETED, st
    assert st.bytes_done == st.bytes_total == 512 * CHUNK
    assert reg.get_sample_value("halfmoon_transfer_bytes_total") - bytes_before == 512 * CHUNK
    assert reg.get_sample_value("halfmoon_transfer_batch_seconds_count") - batches_before == 1

    expected = np.zeros(REGION, dtype=np.uint8)
    for s, d in zip(src_slots, dst_slots):
        expected[d * CHUNK:(d + 1) * CHUNK] = src[s * CHUNK:(s + 1) * CHUNK]
    assert peer.sha256(0, REGION) == hashlib.sha256(expected.tobytes()).hexdigest()

    # READ the whole region back (one large get) and compare byte for byte.
    back = _buffer(REGION)
    eng.register_memory(back.ctypes.data, back.nbytes)
    st = eng.wait(eng.submit(seg, [(back.ctypes.data, peer.base, REGION)], Op.READ))
    assert st.state is State.COMPLETED, st
    assert np.array_equal(back, expected)


def test_one_large_write_and_read(tl, peers, engine_factory):
    eng = engine_factory("writer", tl)
    src = _buffer(64 * MiB, seed=2)
    back = _buffer(64 * MiB)
    eng.register_memory(src.ctypes.data, src.nbytes)
    eng.register_memory(back.ctypes.data, back.nbytes)
    peer = peers("target", tl)
    seg = eng.open_segment(peer.descriptor)
    off = 32 * MiB
    st = eng.wait(eng.submit(seg, [(src.ctypes.data, peer.base + off, src.nbytes)]))
    assert st.state is State.COMPLETED, st
    assert peer.sha256(off, src.nbytes) == hashlib.sha256(src.tobytes()).hexdigest()
    assert peer.sha256(0, off) == hashlib.sha256(bytes(off)).hexdigest()  # nothing else touched
    st = eng.wait(eng.submit(seg, [(back.ctypes.data, peer.base + off, back.nbytes)], Op.READ))
    assert st.state is State.COMPLETED, st
    assert np.array_equal(back, src)


def test_notify_observed_only_after_batch_bytes(tl, peers, engine_factory):
    """The peer writes 64 MiB as 512 scattered puts into us, then notifies; whenever the notify
    shows up here, every byte of that batch must already be in place."""
    eng = engine_factory("receiver", tl)
    dst = _buffer(REGION)
    eng.register_memory(dst.ctypes.data, dst.nbytes)
    peer = peers("sender", tl, size=64 * MiB)
    peer.request({"cmd": "open", "descriptor": base64.b64encode(
        eng.publish().SerializeToString()).decode()})
    rng = np.random.default_rng(3)
    for rnd in range(3):
        dst[:] = 0
        seed = 100 + rnd
        peer.request({"cmd": "fill", "seed": seed})
        expected_src = _buffer(64 * MiB, seed=seed)
        slots = rng.permutation(REGION // CHUNK)[:512]
        descs = [[i * CHUNK, dst.ctypes.data + int(s) * CHUNK, CHUNK] for i, s in enumerate(slots)]
        reply = peer.request({"cmd": "submit", "segment": "receiver", "descs": descs,
                              "op": "WRITE", "wait": False,
                              "notify": base64.b64encode(f"round {rnd}".encode()).decode()})
        assert "bid" in reply
        got = eng.wait_notify(30.0)
        # check the bytes right away, before anything else can happen
        ok = all(np.array_equal(dst[int(s) * CHUNK:(int(s) + 1) * CHUNK],
                                expected_src[i * CHUNK:(i + 1) * CHUNK]) for i, s in enumerate(slots))
        assert [(n.sender, n.payload) for n in got] == [("sender", f"round {rnd}".encode())]
        assert ok, f"round {rnd}: notify arrived before the batch's bytes"


def test_peer_killed_mid_batch_fails_and_survivor_continues(tl, peers, engine_factory):
    eng = engine_factory("survivor", tl, timeout_s=5.0)
    src = _buffer(REGION, seed=4)
    eng.register_memory(src.ctypes.data, src.nbytes)
    victim = peers("victim", tl)
    seg = eng.open_segment(victim.descriptor)
    # 2 GiB in 16384 writes: long enough to be in flight when the SIGKILL lands
    descs = [(src.ctypes.data + (i % 1024) * CHUNK, victim.base + ((i * 7) % 1024) * CHUNK, CHUNK)
             for i in range(16384)]
    reg = metrics.build_registry(groups=["transfer"])
    labels = {"reason": "peer_unreachable"}
    failed_before = reg.get_sample_value("halfmoon_transfer_failures_total", labels)
    bid = eng.submit(seg, descs, coalesce=False)
    nid = eng.send_notify(seg, b"pages ready")  # queued behind the batch
    time.sleep(0.02)
    assert eng.status(bid).state is State.PENDING
    victim.kill()
    t0 = time.monotonic()
    st = eng.wait(bid)
    elapsed = time.monotonic() - t0
    assert st.state is State.FAILED, st
    assert elapsed < 5.0 + 1.0
    assert st.reason
    assert reg.get_sample_value("halfmoon_transfer_failures_total", labels) - failed_before == 1, st.reason
    nst = eng.wait(nid)
    assert nst.state is State.FAILED, nst  # never claims pages that did not arrive
    with pytest.raises(SegmentClosed):
        eng.submit(seg, descs[:1])

    third = peers("third", tl)
    seg3 = eng.open_segment(third.descriptor)
    d3 = [(src.ctypes.data + i * CHUNK, third.base + (511 - i) * CHUNK, CHUNK) for i in range(512)]
    st = eng.wait(eng.submit(seg3, d3))
    assert st.state is State.COMPLETED, st
    expected = np.zeros(REGION, dtype=np.uint8)
    for i in range(512):
        expected[(511 - i) * CHUNK:(512 - i) * CHUNK] = src[i * CHUNK:(i + 1) * CHUNK]
    assert third.sha256(0, REGION) == hashlib.sha256(expected.tobytes()).hexdigest()


def test_stopped_peer_times_out_over_tcp(peers, engine_factory):
    """A peer that stops answering (SIGSTOP, no connection reset) is caught by the batch deadline."""
    eng = engine_factory("writer", "tcp", timeout_s=1.5)
    src = _buffer(64 * MiB, seed=5)
    eng.register_memory(src.ctypes.data, src.nbytes)
    peer = peers("frozen", "tcp")
    seg = eng.open_segment(peer.descriptor)
    assert eng.wait(eng.submit(seg, [(src.ctypes.data, peer.base, CHUNK)])).state is State.COMPLETED
    peer.kill(19)  # SIGSTOP
    try:
        t0 = time.monotonic()
        bid = eng.submit(seg, [(src.ctypes.data, peer.base, src.nbytes)] * 4)
        st = eng.wait(bid)
        elapsed = time.monotonic() - t0
        assert st.state is State.FAILED and "timed out" in st.reason, st
        assert metrics.build_registry(groups=["transfer"]).get_sample_value(
            "halfmoon_transfer_failures_total", {"reason": "timeout"}) >= 1
        assert 1.0 < elapsed < 1.5 + 3.0  # deadline + scheduling slack on a loaded box
        assert not seg.alive
    finally:
        peer.kill(9)


def test_bad_inputs_get_clear_errors(peers, engine_factory):
    eng = engine_factory("checker", "tcp")
    src = _buffer(MiB, seed=6)
    eng.register_memory(src.ctypes.data, src.nbytes)
    peer = peers("target", "tcp", size=4 * MiB)
    good = peer.descriptor

    def edited(**changes):
        d = type(good)()
        d.CopyFrom(good)
        for k, v in changes.items():
            setattr(d, k, v)
        return d

    with pytest.raises(DescriptorError, match="no name"):
        eng.open_segment(edited(name=""))
    with pytest.raises(DescriptorError, match="truncated"):
        eng.open_segment(edited(worker_address=good.worker_address[:8]))
    with pytest.raises(DescriptorError, match="digest"):
        eng.open_segment(edited(worker_address=bytes(len(good.worker_address))))
    bad_rkey = edited()
    bad_rkey.regions[0].rkey = b"\x01" * len(good.regions[0].rkey)
    with pytest.raises(DescriptorError, match="digest"):
        eng.open_segment(bad_rkey)
    with pytest.raises(DescriptorError):
        eng.open_segment(12345)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="resolver"):
        eng.open_segment("unknown-name")

    seg = eng.open_segment(good)
    base = peer.base
    with pytest.raises(BoundsError, match="descriptor 1: remote range"):
        eng.submit(seg, [(src.ctypes.data, base, 16), (src.ctypes.data, base + 4 * MiB - 8, 16)])
    with pytest.raises(BoundsError, match="local range"):
        eng.submit(seg, [(src.ctypes.data + MiB - 8, base, 16)])
    with pytest.raises(ValueError, match="nbytes"):
        eng.submit(seg, [(src.ctypes.data, base, 0)])
    with pytest.raises(ValueError, match="descriptor 0"):
        eng.submit(seg, [("x", base)])
    with pytest.raises(KeyError):
        eng.status(10**9)
    with pytest.raises(ValueError):
        eng.register_memory(src.ctypes.data + 100, 10)  # overlaps
    with pytest.raises(ValueError, match="location"):
        eng.register_memory(12345, 10, "tpu")
    # nothing reached UCX: the segment still works
    st = eng.wait(eng.submit(seg, [(src.ctypes.data, base, MiB)]))
    assert st.state is State.COMPLETED, st
    assert peer.sha256(0, MiB) == hashlib.sha256(src.tobytes()).hexdigest()


def test_idle_progress_thread_sleeps(engine_factory):
    """An idle engine's progress thread blocks in poll(): it uses (almost) no CPU."""
    eng = engine_factory("idle", "tcp")
    tid = eng._thread.native_id
    import os

    def cpu_ticks() -> int:
        with open(f"/proc/{os.getpid()}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    time.sleep(0.2)
    before = cpu_ticks()
    time.sleep(1.0)
    used = cpu_ticks() - before
    assert used <= 5, f"idle progress thread used {used} ticks in 1 s"


def test_concurrent_submitters(tl, peers, engine_factory):
    """Several caller threads submit at once through the one progress thread."""
    eng = engine_factory("multi", tl)
    src = _buffer(16 * MiB, seed=8)
    eng.register_memory(src.ctypes.data, src.nbytes)
    peer = peers("target", tl, size=16 * MiB)
    seg = eng.open_segment(peer.descriptor)
    def worker(k: int) -> None:
        for j in range(8):
            i = k * 8 + j
            d = [(src.ctypes.data + i * 256 * 1024, peer.base + i * 256 * 1024, 256 * 1024)]
            st = eng.wait(eng.submit(seg, d))
            assert st.state is State.COMPLETED, st

    run_in_threads(worker, 8)
    assert peer.sha256(0, 16 * MiB) == hashlib.sha256(src.tobytes()).hexdigest()


def test_concurrent_opens_share_one_endpoint(tl, engine_factory):
    """Threads opening the same peer at once get one Segment; notifies sent through it all arrive.

    Two endpoints to one peer would each carry part of the batches and notifies, and the handle
    that is not kept would orphan what was posted on it."""
    sender = engine_factory("racer", tl)
    receiver = engine_factory("target", tl)
    buf = _buffer(MiB)
    receiver.register_memory(buf.ctypes.data, buf.nbytes)
    desc = receiver.publish()
    segs = []
    barrier = threading.Barrier(6)

    def opener(k: int) -> None:
        barrier.wait()
        seg = sender.open_segment(desc)
        segs.append(seg)
        st = sender.wait(sender.send_notify(seg, f"n{k}".encode()))
        assert st.state is State.COMPLETED, st

    run_in_threads(opener, 6)
    assert len({id(s) for s in segs}) == 1
    got, deadline = [], time.monotonic() + 30.0
    while len(got) < 6 and time.monotonic() < deadline:
        got += [n.payload for n in receiver.wait_notify(1.0)]
    assert sorted(got) == sorted(f"n{k}".encode() for k in range(6))

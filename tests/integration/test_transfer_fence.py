"""The transfer engine's write fence (``submit(..., not_after=)`` / ``send_notify(..., not_after=)``)
between real processes over UCX shared memory: a batch whose deadline passes while it is still
queued for the progress thread is refused right before its puts, and nothing reaches the peer.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from tests.integration.transfer_peer import PeerProcess, fill_bytes
from transfer_svc import State, TransferEngine

MiB = 1 << 20


def test_not_after_refuses_a_batch_queued_past_its_deadline(monkeypatch):
    # the hook makes the progress thread sleep before each write batch, as a stopped process would
    monkeypatch.setenv("HALFMOON_TEST_PUT_DELAY_S", "0.4")
    src = np.zeros(4 * MiB, dtype=np.uint8)
    fill_bytes(src, 7)
    peer = PeerProcess("fence-target", size=8 * MiB, transports="sm", timeout_s=30.0)
    eng = TransferEngine("fence-writer", transports="sm", timeout_s=30.0)
    try:
        eng.register_memory(src.ctypes.data, src.nbytes)
        seg = eng.open_segment(peer.descriptor)
        half = 2 * MiB
        now = time.monotonic()
        first = eng.submit(seg, [(src.ctypes.data, peer.base, half)], not_after=now + 5.0)
        # queued behind the first batch's delay: its deadline passes before the thread gets to it
        late = eng.submit(seg, [(src.ctypes.data + half, peer.base + half, half)], not_after=now + 0.2)
        note = eng.send_notify(seg, b"late", not_after=now + 0.2)
        assert eng.wait(first).state is State.COMPLETED
        st = eng.wait(late)
        assert st.state is State.FAILED and "write deadline passed" in st.reason, st
        st = eng.wait(note)
        assert st.state is State.FAILED and "write deadline passed" in st.reason, st
        assert peer.sha256(0, half) == hashlib.sha256(src[:half].tobytes()).hexdigest()
        assert peer.sha256(half, half) == hashlib.sha256(bytes(half)).hexdigest()  # untouched
        # a refused batch does not drop the segment: later writes in their window still go
        ok = eng.submit(seg, [(src.ctypes.data + half, peer.base + half, half)],
                        not_after=time.monotonic() + 5.0)
        assert eng.wait(ok).state is State.COMPLETED
        assert eng.wait(eng.send_notify(seg, b"ok", not_after=time.monotonic() + 5.0)).state is State.COMPLETED
        assert peer.sha256(half, half) == hashlib.sha256(src[half:].tobytes()).hexdigest()
    finally:
        eng.close()
        peer.close()

"""Engine + registry together: open segments by name, survive a peer restart (new incarnation)."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from tests.integration.test_registry import RegistryProc
from tests.integration.transfer_peer import PeerProcess, fill_bytes
from transfer_svc import SegmentClosed, State, TransferEngine
from transfer_svc.registry_client import RegistryClient

MiB = 1 << 20


@pytest.mark.parametrize("tl", ["sm", "tcp"])
def test_peer_restart_gives_fresh_descriptor_that_works(tl):
    reg = RegistryProc(ttl=2)
    client = RegistryClient(reg.address, worker_id="prefill-0", role="prefill")
    eng = TransferEngine("prefill-0", transports=tl, resolver=client, timeout_s=5.0)
    peers = []
    try:
        src = np.zeros(8 * MiB, dtype=np.uint8)
        fill_bytes(src, 11)
        eng.register_memory(src.ctypes.data, src.nbytes)
        client.publish(eng.publish())

        b1 = PeerProcess("decode-0", size=8 * MiB, transports=tl, registry=reg.address, ttl=2)
        peers.append(b1)
        seg = eng.open_segment("decode-0")
        assert seg.incarnation == b1.descriptor.incarnation
        assert eng.open_segment("decode-0") is seg  # same incarnation: same handle
        st = eng.wait(eng.submit(seg, [(src.ctypes.data, b1.base, 4 * MiB)]))
        assert st.state is State.COMPLETED, st

        b1.kill()
        b1.proc.wait()
        # the dead peer's handle fails (tcp: connection reset; sm: owner process gone)
        try:
            st = eng.wait(eng.submit(seg, [(src.ctypes.data, b1.base, 4 * MiB)]))
            assert st.state is State.FAILED, st
        except SegmentClosed:
            pass

        b2 = PeerProcess("decode-0", size=8 * MiB, transports=tl, registry=reg.address, ttl=2)
        peers.append(b2)
        assert b2.descriptor.incarnation != b1.descriptor.incarnation
        seg2 = eng.open_segment("decode-0", incarnation=b2.descriptor.incarnation)
        assert seg2 is not seg and seg2.incarnation == b2.descriptor.incarnation
        with pytest.raises(SegmentClosed):
            eng.submit(seg, [(src.ctypes.data, b1.base, 16)])
        st = eng.wait(eng.submit(seg2, [(src.ctypes.data, b2.base + MiB, 4 * MiB)]))
        assert st.state is State.COMPLETED, st
        assert b2.sha256(MiB, 4 * MiB) == hashlib.sha256(src[:4 * MiB].tobytes()).hexdigest()

        # its lease expires when it stops heartbeating: the name disappears from the registry
        b2.kill(19)  # SIGSTOP: no heartbeats, no unregister
        deadline = time.monotonic() + 10
        while True:
            try:
                client.get_segment("decode-0", refresh=True)
            except KeyError:
                break
            assert time.monotonic() < deadline, "lease did not expire"
            time.sleep(0.2)
        with pytest.raises(KeyError):
            eng.open_segment("decode-0x")
    finally:
        for p in peers:
            p.kill(9)
            p.close()
        eng.close()
        client.close()
        reg.stop()

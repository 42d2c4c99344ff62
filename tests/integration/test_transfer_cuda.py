"""CUDA memory through the transfer engine (UCS_MEMORY_TYPE_CUDA; UCX picks cuda_ipc / cuda_copy).

Runs only where torch sees a GPU (marker `gpu`): two processes, GPU buffer -> GPU buffer (the peer
on the second GPU when there are two), scattered and large writes and a READ back, byte-exact.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from tests.integration.transfer_peer import PeerProcess  # noqa: E402
from transfer_svc import Op, State, TransferEngine  # noqa: E402

MiB = 1 << 20
CHUNK = 512 * 1024
REGION = 256 * MiB


def test_gpu_to_gpu_scattered_large_and_read():
    peer_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    g = torch.Generator(device="cuda:0").manual_seed(0)
    src = torch.randint(0, 256, (REGION,), dtype=torch.uint8, device="cuda:0", generator=g)
    back = torch.zeros(REGION, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    eng = TransferEngine("gpu-writer", timeout_s=30)
    peer = PeerProcess("gpu-target", size=REGION, device=peer_dev, timeout_s=30)
    try:
        eng.register_memory(src.data_ptr(), REGION, "cuda:0")
        eng.register_memory(back.data_ptr(), REGION, "cuda:0")
        seg = eng.open_segment(peer.descriptor)
        rng = np.random.default_rng(1)
        n = REGION // CHUNK
        src_slots, dst_slots = rng.permutation(n)[:n // 2], rng.permutation(n)[:n // 2]
        descs = [(src.data_ptr() + int(s) * CHUNK, peer.base + int(d) * CHUNK, CHUNK)
                 for s, d in zip(src_slots, dst_slots)]
        for _ in range(2):  # the first includes connection setup and IPC handle mapping
            t0 = time.perf_counter()
            st = eng.wait(eng.submit(seg, descs, Op.WRITE))
            dt = time.perf_counter() - t0
        assert st.state is State.COMPLETED, st
        print(f"\n{len(descs)} scattered {CHUNK // 1024} KiB GPU writes: "
              f"{st.bytes_total / dt / 1e9:.1f} GB/s ({peer_dev})")
        host_src = src.cpu().numpy()
        expected = np.zeros(REGION, dtype=np.uint8)
        for s, d in zip(src_slots, dst_slots):
            expected[d * CHUNK:(d + 1) * CHUNK] = host_src[s * CHUNK:(s + 1) * CHUNK]
        assert peer.sha256(0, REGION) == hashlib.sha256(expected.tobytes()).hexdigest()

        for _ in range(2):
            t0 = time.perf_counter()
            st = eng.wait(eng.submit(seg, [(src.data_ptr(), peer.base, REGION)]))
            dt = time.perf_counter() - t0
        assert st.state is State.COMPLETED, st
        print(f"one {REGION // MiB} MiB GPU write: {REGION / dt / 1e9:.1f} GB/s")
        st = eng.wait(eng.submit(seg, [(back.data_ptr(), peer.base, REGION)], Op.READ))
        assert st.state is State.COMPLETED, st
        torch.cuda.synchronize()
        assert torch.equal(back, src)
    finally:
        peer.close()
        eng.close()

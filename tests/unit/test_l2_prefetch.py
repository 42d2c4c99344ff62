"""engine.l2_prefetch: the chunking, the env choice, and on the GPU that a prefetch changes no result."""

from __future__ import annotations

import pytest
import torch

from engine.l2_prefetch import CHUNK, byte_view, chunks_per_program, prefetch_mode


def test_chunks_cover_the_tensor_in_a_power_of_two_per_program():
    for nbytes, programs in [(32 << 20, 256), (32 << 20, 320), (32 << 20, 512), (CHUNK, 512), (5 * CHUNK, 3)]:
        n = chunks_per_program(nbytes, programs)
        assert n & (n - 1) == 0 and n >= 1
        assert programs * n * CHUNK >= nbytes  # every byte is asked for
        assert n == 1 or programs * (n // 2) * CHUNK < nbytes  # and no more than twice over
    assert chunks_per_program(32 << 20, 256) == 8  # B=1: 8 KV heads x 32 splits, 32 MiB of o weight


def test_mode_reads_the_env_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv("HALFMOON_L2_PREFETCH", raising=False)
    assert prefetch_mode() == "off"
    monkeypatch.setenv("HALFMOON_L2_PREFETCH", "o")
    assert prefetch_mode() == "o"
    monkeypatch.setenv("HALFMOON_L2_PREFETCH", "everything")
    with pytest.raises(ValueError, match="HALFMOON_L2_PREFETCH"):
        prefetch_mode()


def test_byte_view_needs_contiguous_aligned_memory():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert byte_view(w).dtype == torch.uint8 and byte_view(w).numel() == 64 * 64 * 2
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(w.t())
    with pytest.raises(ValueError, match="aligned"):
        byte_view(w.view(-1)[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs an sm90+ CUDA device")
@pytest.mark.parametrize("B,C", [(1, 1024), (8, 4096), (40, 300)])
def test_the_attention_output_is_bit_equal_with_the_prefetch_on_gpu(B, C):
    """The split-KV kernel with ``prefetch`` (a 32 MiB + 48-byte weight: the tail past the last whole
    chunk is skipped, programs past the end re-ask for the last chunk) returns exactly what it
    returns without; the standalone kernel runs on the same weight and on one below a chunk."""
    from engine.attention.split_kv_decode import SplitKVDecode
    from engine.l2_prefetch import prefetch_l2

    g = torch.Generator(device="cuda").manual_seed(B + C)
    H, KVH, D, PS = 32, 8, 128, 16
    npr = -(-C // PS)
    P = B * npr + 1
    k = torch.randn(P, PS, KVH, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(P, PS, KVH, D, device="cuda", generator=g).bfloat16()
    table = torch.randperm(P - 1, device="cuda", generator=g).view(B, npr)
    t = torch.arange(npr * PS, device="cuda")
    r2t = (table[:, t // PS] * PS + t % PS).to(torch.int64)
    rows = torch.arange(B, device="cuda")
    seq = torch.tensor([C - (i % 5) for i in range(B)], device="cuda")
    q = torch.randn(B, H, D, device="cuda", generator=g).bfloat16()
    w = torch.randn((32 << 20) // 2 + 24, device="cuda", generator=g).bfloat16()
    att = SplitKVDecode(H, KVH, D, PS, B, "cuda")
    plain = att(q, k, v, r2t, rows, seq)
    for _ in range(5):
        assert torch.equal(att(q, k, v, r2t, rows, seq, prefetch=byte_view(w)), plain)
    prefetch_l2(w)
    prefetch_l2(w[: CHUNK // 4])  # below one chunk: nothing to ask for
    torch.cuda.synchronize()
    assert int(att.counter.abs().sum()) == 0

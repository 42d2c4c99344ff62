"""The ``torch_paged`` backend's page-level decode gather is bit-identical to the reference ``torch``
backend: ragged rows (1 token, a page minus one, exactly a page, a page plus one, many pages) on
shuffled pages, stale slots past each row's end, both pool layouts; extend over a cached prefix reads the
reference values and shapes. ``auto`` picks it on CPU when the cpu_paged kernel is not built."""

from __future__ import annotations

import pytest
import torch

from engine.attention import create_backend, resolve_backend_name
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.req_to_token_pool import ReqToTokenPool

PS, LAYERS, H, KVH, D = 4, 2, 6, 2, 8
LENS = [1, PS - 1, PS, PS + 1, 9 * PS + 2]


def _setup(layout: str):
    g = torch.Generator().manual_seed(0)
    pages = sum(-(-(n + 1) // PS) for n in LENS) + 3
    pool = KVPool(pages, PS, LAYERS, KVH, D, torch.float32, "cpu", layout=layout)
    for buf in pool.buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))
    r2t = ReqToTokenPool(len(LENS) + 1, 64)
    order = torch.randperm(pages, generator=g).tolist()  # pages of a row are not consecutive
    rows = []
    for n in LENS:
        row = r2t.alloc()
        own = [order.pop() for _ in range(-(-(n + 1) // PS))]
        slots = (torch.tensor(own)[:, None] * PS + torch.arange(PS)[None, :]).reshape(-1)[:n + 1]
        r2t.write(row, 0, slots)
        r2t.req_to_token[row, n + 1:] = order[0] * PS  # stale slots past the row's end (a real page)
        rows.append(row)
    kw = dict(kv_pool=pool, req_to_token_pool=r2t, num_heads=H, num_kv_heads=KVH, head_dim=D)
    return pool, r2t, rows, kw, g


@pytest.mark.parametrize("layout", ["page_major", "layer_major"])
def test_paged_decode_bit_identical_to_reference(layout):
    pool, r2t, rows, kw, g = _setup(layout)
    batch = ForwardBatch.decode(rows, LENS, [0] * len(LENS), r2t.req_to_token)
    q = torch.randn(len(LENS), H, D, generator=g)
    k, v = torch.randn(len(LENS), KVH, D, generator=g), torch.randn(len(LENS), KVH, D, generator=g)
    outs = {}
    for name in ("torch", "torch_paged"):
        backend = create_backend(name, **kw)
        backend.init_forward(batch)
        outs[name] = [backend.forward(q, k, v, layer, batch) for layer in range(LAYERS)]
    assert type(create_backend("torch_paged", **kw)).__name__ == "TorchPagedAttentionBackend"
    for a, b in zip(outs["torch"], outs["torch_paged"]):
        assert a.shape == (len(LENS), H * D)
        assert torch.equal(a, b)
    # the new tokens' K/V were written where the batch said
    torch.testing.assert_close(pool.read(1, batch.out_cache_loc)[0], k)


def test_paged_decode_page_table_built_once_per_step():
    pool, r2t, rows, kw, _ = _setup("page_major")
    backend = create_backend("torch_paged", **kw)
    batch = ForwardBatch.decode(rows, LENS, [0] * len(LENS), r2t.req_to_token)
    backend.init_forward(batch)
    n_pages = -(-(max(LENS) + 1) // PS)
    want = []
    for row, n in zip(rows, LENS):
        own = -(-(n + 1) // PS)
        want += [int(r2t.req_to_token[row, j * PS]) // PS if j < own else 0 for j in range(n_pages)]
    assert backend._pages.tolist() == want  # whole pages, [B * Lp], padding at page 0


def test_paged_extend_over_a_prefix_bit_identical_to_reference():
    pool, r2t, rows, kw, g = _setup("page_major")
    row, n = rows[-1], LENS[-1]
    pre = 2 * PS
    batch = ForwardBatch.build(ForwardMode.EXTEND, [row], [pre], [[0] * (n + 1 - pre)],
                               r2t.req_to_token[row, pre:n + 1].clone())
    T = n + 1 - pre
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
    outs = []
    for name in ("torch", "torch_paged"):
        backend = create_backend(name, **kw)
        backend.init_forward(batch)
        outs.append(backend.forward(q, k, v, 0, batch))
    pages, n = backend._reqs[0][2]  # the paged backend keeps whole pages of the row, not slots
    assert n == LENS[-1] + 1 and pages.tolist() == (r2t.req_to_token[row, :n:PS] // PS).tolist()
    assert torch.equal(outs[0], outs[1])


def test_auto_is_torch_paged_on_cpu_without_the_kernel(monkeypatch):
    from engine.cpu_kernels import PAGED_DECODE as cpu_kernel

    monkeypatch.setattr(cpu_kernel, "_loaded", (None, "HALFMOON_CPU_KERNEL=off"))
    assert resolve_backend_name("auto", torch.device("cpu"), torch.float32) == "torch_paged"

"""flashinfer plans queued ahead of the device: a wrapper's next ``plan`` must not overwrite the
staged schedule of a forward the device has not started (engine/attention/flashinfer_backend.py,
``PlanFence``). The fence's ordering runs everywhere with fake events; the GPU tests stall the
stream, plan and run two extend batches back to back through the backend, and check the first
batch's attention against torch (FA3 takes each work item's kv length from the staged schedule).
"""

from __future__ import annotations

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Log:
    def __init__(self):
        self.calls: list[tuple] = []

    def event(self):
        log, n = self, sum(1 for c in self.calls if c[0] == "new")
        self.calls.append(("new", n))

        class _Event:
            def synchronize(self):
                log.calls.append(("wait", n))

            def record(self, stream=None):
                log.calls.append(("record", n))

        return _Event()


class _Wrapper:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def plan(self, *args, **kwargs):
        self.log.calls.append(("plan", self.name, args, kwargs))


def test_fence_waits_for_the_wrappers_last_plan_before_planning_it_again():
    from engine.attention.flashinfer_backend import PlanFence

    log = _Log()
    fence = PlanFence(make_event=log.event)
    a, b = _Wrapper(log, "a"), _Wrapper(log, "b")
    fence.plan(a, 1, causal=True)
    fence.plan(b, 2)
    fence.plan(a, 3)
    fence.plan(a, 4)
    assert log.calls == [
        ("new", 0), ("plan", "a", (1,), {"causal": True}), ("record", 0),  # first plan: nothing to wait for
        ("new", 1), ("plan", "b", (2,), {}), ("record", 1),  # b has its own staging buffer and event
        ("wait", 0), ("plan", "a", (3,), {}), ("record", 0),  # a again: wait for a's last copy first
        ("wait", 0), ("plan", "a", (4,), {}), ("record", 0),
    ]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("extend_mode", ["paged", "ragged"])
def test_fa3_extend_planned_ahead_of_the_device_uses_its_own_schedule(extend_mode):
    """Batch A (prefix 1024 + 256 new) then batch B (prefix 256 + 256 new, the same number of work
    items) planned while the stream sleeps: A's output must match torch. Without the fence A ran
    with B's schedule (kv 512 for the paged kernel in "paged" mode, a 256-token prefix in "ragged")."""
    from engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.kvcache.kv_pool import KVPool
    from engine.kvcache.page_allocator import PageAllocator
    from engine.kvcache.req_to_token_pool import ReqToTokenPool

    H, KVH, D, ps, dev, dt = 32, 8, 128, 16, "cuda", torch.bfloat16
    torch.manual_seed(0)
    pool = KVPool(256, ps, 1, KVH, D, dt, dev)
    pool.k_pages(0).normal_()
    pool.v_pages(0).normal_()
    alloc = PageAllocator(256, ps, dev)
    alloc._free = [int(p) for p in torch.randperm(256)]  # page tables that are not the identity
    r2t = ReqToTokenPool(4, 2048, dev)
    batches = []
    for pre, ext in ((1024, 256), (256, 256)):
        row = r2t.alloc()
        slots = alloc.alloc_slots(0, pre + ext, None)
        r2t.write(row, 0, slots)
        b = ForwardBatch.build(ForwardMode.EXTEND, [row], [pre], [[0] * ext], slots[pre:], dev)
        qkv = (torch.randn(ext, H, D, dtype=dt, device=dev), torch.randn(ext, KVH, D, dtype=dt, device=dev),
               torch.randn(ext, KVH, D, dtype=dt, device=dev))
        batches.append((b, qkv))
    tb = TorchAttentionBackend(pool, r2t, H, KVH, D)
    refs = []
    for b, (q, k, v) in batches:
        tb.init_forward(b)
        refs.append(tb.forward(q, k, v, 0, b).clone())
    fi = FlashInferAttentionBackend(pool, r2t, H, KVH, D, prefill_backend="fa3", extend_mode=extend_mode)
    for b, (q, k, v) in batches:  # compile / load the kernels outside the timed-free race below
        fi.init_forward(b)
        fi.forward(q, k, v, 0, b)
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 28)  # ~0.14 s: both batches are planned before the device reaches A's copy
    outs = []
    for b, (q, k, v) in batches:
        fi.init_forward(b)
        outs.append(fi.forward(q, k, v, 0, b))
    torch.cuda.synchronize()
    errs = [_rel(o, r) for o, r in zip(outs, refs)]
    assert errs[0] <= 1e-2 and errs[1] <= 1e-2, errs

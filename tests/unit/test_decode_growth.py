"""D's on-demand page growth: a running request takes its next page whole, once per page.

A request admitted with a 1-token decode reserve outgrows it at its first decode step; from then
on each step needs one slot more. Growing the row one slot per step costs a pool call, a row
write and a read of the row's last slot (a device sync on CUDA) per request per step; growing to
the page's end costs that once per page. The tokens must stay the co-located engine's, and the
accounting exact.
"""

from __future__ import annotations

import pytest

from decode_svc.jobs import JobState
from tests.unit.test_decode_scheduler import PS, Decode, model, outcome, reference  # noqa: F401

PROMPT = [5, 17, 33, 2, 41, 8, 60, 12, 9, 70]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_growth_takes_whole_pages_once_per_page(model, reference, overlap):
    d = Decode(model, reserved_decode_tokens=1, overlap_schedule=overlap)
    want = reference(PROMPT, 30)
    job = d.submit(PROMPT, 30)
    d.tick()
    d.prefill(job, want[0])
    grows, alloc = 0, None
    for _ in range(100):
        if job.state is JobState.DONE:
            break
        d.tick()
        if job.lease is None:
            continue
        if job.lease.alloc_len != alloc:
            if alloc is not None:  # a growth (the first value is the admission's)
                grows += 1
                assert job.lease.alloc_len % PS == 0, job.lease.alloc_len  # it ends on a page boundary
            alloc = job.lease.alloc_len
            assert alloc >= job.kv_len
    d.tick()
    assert outcome(job) == (want, None)
    # 10 prompt + 30 tokens: slots 11..40 added one page at a time, not one slot per step
    assert 0 < grows <= -(-(len(PROMPT) + 30) // PS), grows
    d.assert_idle()

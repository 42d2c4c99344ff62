"""D's unblock step on P's notice (decode_svc/kv_wait.py, pd_common/head_blocks.py), in one process
with the decode harness (a tiny 2-kv-head model, the test playing P): delta pages that P wrote
head-blocked (as P TP=2 -> D TP=1 leaves them) are rewritten token-major before the commit, so D's
tokens equal the co-located engine's (they do not when the pages stay blocked); a notice whose cuts
are malformed fails the request DATA_LOSS before anything changes; the accounting ends idle."""

from __future__ import annotations

import grpc
import torch

from protos import prefill_pb2
from tests.unit.decode_harness import PROMPT, Decode, code, model, outcome, reference  # noqa: F401


def block_pages(d: Decode, pages: list[int]) -> None:
    """Rewrite ``pages`` of D's pool as P's writes of heads [0, 1) and [1, 2) leave them."""
    region = d.runner.kv_pool.region
    idx = torch.tensor(pages)
    page = region[idx]
    blocks = [page[:, :, :, :, h:h + 1].reshape(len(pages), -1) for h in range(2)]
    region[idx] = torch.cat(blocks, dim=1).view_as(page)


def test_head_blocked_delta_pages_are_unblocked_before_the_commit(model, reference):
    ref = reference(PROMPT, 6)
    for cuts, want in (([0, 1, 2], True), ([], False)):
        d = Decode(model)
        job = d.submit(PROMPT, 6)
        d.tick(2)
        dst = list(d.net.dests[job.room].dst_page_ids)
        d.prefill(job, ref[0], head_block_cuts=cuts)  # computes the delta's KV token-major, notifies
        with torch.inference_mode():  # what P's per-rank writes leave, before D reads the notice
            before = d.runner.kv_pool.region[dst].clone()
            block_pages(d, dst)
        assert not torch.equal(d.runner.kv_pool.region[dst], before)
        d.run_until_done(job)
        tokens, error = outcome(job)
        assert error is None
        assert (tokens == ref) is want  # without the unblock D attends over scrambled heads
        if want:  # the prompt's full pages (decode wrote its tokens into the last one)
            assert torch.equal(d.runner.kv_pool.region[dst[:-1]], before[:-1])
        d.assert_idle()


def test_malformed_cuts_fail_the_request_and_change_nothing(model):
    d = Decode(model)
    job = d.submit(PROMPT)
    d.tick(2)
    dst = list(d.net.dests[job.room].dst_page_ids)
    snapshot = d.runner.kv_pool.region[dst].clone()
    d.recv.send(prefill_pb2.KVNotice(room=job.room, ok=True, pages_sent=len(dst), head_block_cuts=[0, 3]))
    d.tick()
    err = outcome(job)[1]
    assert code(err) is grpc.StatusCode.DATA_LOSS and "not increasing from 0 to 2" in str(err), err
    assert torch.equal(d.runner.kv_pool.region[dst], snapshot)
    d.assert_idle()

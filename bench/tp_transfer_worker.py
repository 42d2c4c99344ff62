"""One tensor-parallel rank of the TP transfer benchmark (bench/tp_transfer.py), as a process: its
page_major pool of its kv heads plus a staging area, both in one buffer registered with its own
``TransferEngine``, answering the controller's JSON-line commands (bench/transfer_worker.py ``Proc``).

Commands: P rank: connect (open every D rank's segment), run (one batch of writes, strided,
gathered, or serving's head-blocked writes through ``pd_common.staged_writes.RankWrites``: monotonic
end time, gather seconds, descriptors submitted); D rank: scatter (staged writes into the pool:
seconds), unblock (serving's ``pd_common.head_blocks.unblock_pages``: seconds), check (does the
pool hold the expected elements), zero, exit.

Pools hold int32 elements (4 bytes, as fp32; the transfer copies bytes): element
``(page, layer, kv, token, head, dim)`` of the whole model's pool is its row-major index in a pool
of every kv head, so a D rank can check what it received without the P pools.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

import torch

from bench.strided_slices import slice_descriptors
from bench.transfer_worker import _reply, private_stdout
from pd_common import PageShape, RankRegion, RankWrite

LAYERS, HEADS, HEAD_DIM, PAGE, ITEM = 30, 3, 64, 16, 4  # SmolLM2-135M, page 16, 4-byte elements
SHAPE = PageShape(LAYERS, PAGE, HEAD_DIM, ITEM)


def expected(pages: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The whole model's pool at ``pages`` (page ids into the P pool of every head), heads [lo, hi):
    int32 [len(pages), LAYERS, 2, PAGE, hi - lo, HEAD_DIM]."""
    def ax(n, dim, start=0):
        shape = [1] * 6
        shape[dim] = n
        return torch.arange(start, start + n, dtype=torch.int64).view(shape)
    idx = pages.to(torch.int64).view(-1, 1, 1, 1, 1, 1)
    out = ((((idx * LAYERS + ax(LAYERS, 1)) * 2 + ax(2, 2)) * PAGE + ax(PAGE, 3)) * HEADS
           + ax(hi - lo, 4, lo)) * HEAD_DIM + ax(HEAD_DIM, 5)
    return out.to(torch.int32)


class Rank:
    """A rank's buffer: pool ``[pool_pages, LAYERS, 2, PAGE, heads, HEAD_DIM]`` then ``staging``
    elements (int32), registered as one region."""

    def __init__(self, side: str, rank: int, lo: int, hi: int, pool_pages: int, stage_pages: int):
        from transfer_svc import TransferEngine

        self.side, self.rank, self.lo, self.hi = side, rank, lo, hi
        page_elems = 2 * LAYERS * PAGE * (hi - lo) * HEAD_DIM
        self.buf = torch.zeros(pool_pages * page_elems + stage_pages * page_elems, dtype=torch.int32)
        self.pool = self.buf[:pool_pages * page_elems].view(pool_pages, LAYERS, 2, PAGE, hi - lo, HEAD_DIM)
        self.stage = self.buf[pool_pages * page_elems:]
        if side == "p":
            for s in range(0, pool_pages, 64):  # chunks keep the int64 temporaries small
                self.pool[s:s + 64] = expected(torch.arange(s, min(s + 64, pool_pages)), lo, hi)
        self.base = self.buf.data_ptr()
        self.stage_base = self.stage.data_ptr()
        # strided 512-page batches take longer than the engine's default 10 s deadline on a busy box
        self.eng = TransferEngine(f"tp-{side}{rank}-{os.getpid()}", transports="sm", timeout_s=300)
        self.eng.register_memory(self.base, self.buf.numel() * ITEM)
        self.segs: dict[int, object] = {}
        self.writes = None  # serving's RankWrites, built on the first "blocked" run

    def region(self) -> RankRegion:
        return RankRegion(self.rank, self.lo, self.hi, self.base, self.pool.numel() * ITEM)

    def info(self) -> dict:
        return {"descriptor": base64.b64encode(self.eng.publish().SerializeToString()).decode(),
                "base": self.base, "stage_base": self.stage_base, "length": self.pool.numel() * ITEM}

    def connect(self, dsts: list[dict]) -> None:
        from protos import registry_pb2

        for d in dsts:
            self.segs[d["rank"]] = self.eng.open_segment(registry_pb2.SegmentDescriptor.FromString(
                base64.b64decode(d["descriptor"])))

    def run(self, writes: list[dict], src_pages: list[int], dst_pages: list[int]) -> dict:
        """Post every write of this rank, wait for all -> end time (monotonic), gather seconds,
        descriptors submitted. Building the descriptors is timed: the serving path builds them per
        batch too."""
        t0 = time.monotonic()
        gather_s, n_desc, bids = 0.0, 0, []
        idx = torch.tensor(src_pages, dtype=torch.int64)
        if writes and writes[0]["mode"] == "blocked":
            return self.run_blocked(writes, src_pages, dst_pages, t0)
        for w in writes:
            dst = RankRegion(*w["dst_region"])
            if w["mode"] == "strided":
                descs = slice_descriptors(RankWrite(self.rank, dst.rank, w["lo"], w["hi"]), self.region(),
                                          dst, SHAPE, src_pages, dst_pages)
            else:  # gather the head range of the delta pages into this rank's staging, then put it
                g0 = time.monotonic()
                n = len(src_pages) * 2 * LAYERS * PAGE * (w["hi"] - w["lo"]) * HEAD_DIM
                out = self.stage[w["p_off"]:w["p_off"] + n].view(
                    len(src_pages), LAYERS, 2, PAGE, w["hi"] - w["lo"], HEAD_DIM)
                torch.index_select(self.pool[..., w["lo"] - self.lo:w["hi"] - self.lo, :], 0, idx, out=out)
                gather_s += time.monotonic() - g0
                sa = self.stage_base + w["p_off"] * ITEM
                if w["mode"] == "gather-direct":  # D's page is exactly this head range: page by page
                    step = SHAPE.stride(w["hi"] - w["lo"])
                    descs = [(sa + i * step, dst.base + int(d) * step, step) for i, d in enumerate(dst_pages)]
                else:  # into D's staging, one put
                    descs = [(sa, w["d_stage"], n * ITEM)]
            n_desc += len(descs)
            bids.append(self.eng.submit(self.segs[dst.rank], descs))
        for b in bids:
            st = self.eng.wait(b)
            if st.state.name != "COMPLETED":
                raise RuntimeError(f"rank {self.rank}: {st}")
        t1 = time.monotonic()
        return {"t_start": t0, "t_end": t1, "gather_s": gather_s, "descs": n_desc}

    def run_blocked(self, writes: list[dict], src_pages: list[int], dst_pages: list[int], t0: float) -> dict:
        """Serving's path: every write one block per page, gathered through the rank's staging area
        where it sends only some of its heads (pd_common/staged_writes.py, its default 64 MiB)."""
        from pd_common import DEFAULT_STAGING_MB, RankWrites, Target

        if self.writes is None:
            self.writes = RankWrites(self.eng, self.pool, self.region(), SHAPE, DEFAULT_STAGING_MB << 20)
        targets = [Target(self.segs[w["dst_region"][0]], RankRegion(*w["dst_region"]),
                          RankWrite(self.rank, w["dst_region"][0], w["lo"], w["hi"])) for w in writes]
        jid = self.writes.start(targets, src_pages, dst_pages, None)
        st = self.writes.wait(jid)
        descs, _ = self.writes.puts(jid)
        self.writes.release(jid)
        if st.state.name != "COMPLETED":
            raise RuntimeError(f"rank {self.rank}: {st}")
        return {"t_start": t0, "t_end": time.monotonic(), "gather_s": 0.0, "descs": descs,
                "staging_register_ms": 1e3 * self.writes.staging.register_s,
                "staging_peak": self.writes.staging.peak, "staging_in_use": self.writes.staging.in_use}

    def unblock(self, blocks: list[list[int]], dst_pages: list[int]) -> float:
        from pd_common import unblock_pages

        t0 = time.monotonic()
        unblock_pages(self.pool, dst_pages, blocks)
        return time.monotonic() - t0

    def scatter(self, staged: list[dict], dst_pages: list[int]) -> float:
        """Copy each staged write [pages, LAYERS, 2, PAGE, hi - lo, HEAD_DIM] into its heads of the pool."""
        t0 = time.monotonic()
        idx = torch.tensor(dst_pages, dtype=torch.int64)
        for w in staged:
            n = len(dst_pages) * 2 * LAYERS * PAGE * (w["hi"] - w["lo"]) * HEAD_DIM
            src = self.stage[w["d_off"]:w["d_off"] + n].view(len(dst_pages), LAYERS, 2, PAGE, w["hi"] - w["lo"],
                                                            HEAD_DIM)
            self.pool[:, :, :, :, w["lo"] - self.lo:w["hi"] - self.lo].index_copy_(0, idx, src)
        return time.monotonic() - t0

    def check(self, src_pages: list[int], dst_pages: list[int]) -> bool:
        got = self.pool[torch.tensor(dst_pages, dtype=torch.int64)]
        return bool(torch.equal(got, expected(torch.tensor(src_pages), self.lo, self.hi)))


def main(argv: list[str]) -> None:
    side, rank, lo, hi, pool_pages, stage_pages = argv[0], *map(int, argv[1:6])
    torch.set_num_threads(1)
    private_stdout()
    r = Rank(side, rank, lo, hi, pool_pages, stage_pages)
    _reply(r.info())
    for line in sys.stdin:
        c = json.loads(line)
        if c["cmd"] == "connect":
            r.connect(c["dsts"])
            _reply({"ok": True})
        elif c["cmd"] == "run":
            _reply(r.run(c["writes"], c["src_pages"], c["dst_pages"]))
        elif c["cmd"] == "scatter":
            _reply({"seconds": r.scatter(c["staged"], c["dst_pages"])})
        elif c["cmd"] == "unblock":
            _reply({"seconds": r.unblock(c["blocks"], c["dst_pages"])})
        elif c["cmd"] == "check":
            _reply({"ok": r.check(c["src_pages"], c["dst_pages"])})
        elif c["cmd"] == "zero":
            r.pool.zero_()
            _reply({"ok": True})
        elif c["cmd"] == "exit":
            break
    r.eng.close()


if __name__ == "__main__":
    main(sys.argv[1:])

"""A PD worker's tensor-parallel rank 1..N-1: ``python -m pd_common.tp_rank`` (started by rank 0
through ``FollowerSpec``, never by hand).

Besides following rank 0's batches (``engine.distributed.follower.run_follower``) the rank runs its
own transfer engine (``<worker-id>#rank<r>``) with its KV shard registered, and sends rank 0 its
segment descriptor as its first reply; rank 0 folds it into the worker's one descriptor
(transfer_svc/rank_regions.py). On a prefill worker rank 0 then sends it *write commands*
(``WriteCommand``, JSON): the pages and D ranks to write this rank's kv heads into. The rank writes
them on its own engine, one block per page (``pd_common.staged_writes``: straight from its pool, or
gathered through its staging area when it sends only some of its heads), and replies once every put
completed or one failed (``WriteReply``, with the per-(page, kv head) checksums of the heads it wrote
when the command asks), which rank 0 needs before it sends D the notice. On a decode worker it
rewrites head-blocked delta pages token-major when rank 0 says so
(``pd_common.head_blocks.UnblockCommand``, no reply: the pipe's order puts it before any forward or
checksum query reading them), and copies a forked request's partial last page into each sample's
page (``CopyPagesCommand``, the same way). On P and D it answers rank 0's accounting queries
(``pd_common.rank_accounting``) and, on D, its checksum queries (``pd_common.rank_checksums``).
"""

from __future__ import annotations

import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from engine.distributed.follower import parse_args, run_follower
from pd_common import rank_checksums
from pd_common.head_blocks import is_copy_pages, is_unblock, unblock_pages
from pd_common.head_checksums import head_checksums
from pd_common.head_slices import PageShape, RankWrite
from pd_common.rank_accounting import answer, is_accounting
from pd_common.staged_writes import DEFAULT_STAGING_MB, RankWrites, Target
from protos import registry_pb2
from transfer_svc.rank_regions import RankRegion
from transfer_svc.types import State

log = logging.getLogger("halfmoon.worker.tp")


@dataclass
class AgentConfig:
    """What a rank's transfer engine needs (the worker's flags), as ``FollowerSpec.agent_config``."""

    worker_id: str
    transports: str | None
    timeout_s: float
    busy_poll: bool = False
    staging_bytes: int = 0  # prefill: the rank's KV staging area (--kv-staging-mb); decode: 0


@dataclass
class WriteTarget:
    """One D rank to write: its single-rank descriptor (hex of ``rank_descriptor``), its region and
    the head range to write."""

    desc_hex: str
    dst: list[int]  # RankRegion fields: rank, head_start, head_end, base, length
    head_start: int
    head_end: int


@dataclass
class WriteCommand:
    id: int
    targets: list[WriteTarget]
    src_pages: list[int]
    dst_pages: list[int]
    not_after: float | None  # time.monotonic() seconds (one clock for the processes of a host)
    shape: list[int] = field(default_factory=list)  # PageShape fields
    checksums: bool = False  # reply with the written heads' sums of src_pages (--kv-checksums)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "WriteCommand":
        return cls.from_json(json.loads(data))

    @classmethod
    def from_json(cls, d: dict) -> "WriteCommand":
        """From the decoded JSON object (``d`` is consumed)."""
        d["targets"] = [WriteTarget(**t) for t in d["targets"]]
        return cls(**d)


@dataclass
class WriteReply:
    """``sums[i][k]``: crc32 of src page ``k`` for global kv head ``sum_heads[i]`` (the heads this
    rank wrote; empty unless the command asked, ``pd_common.head_checksums``)."""

    id: int
    ok: bool
    reason: str = ""
    puts: int = 0
    nbytes: int = 0
    sum_heads: list[int] = field(default_factory=list)
    sums: list[list[int]] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> "WriteReply":
        return cls(**json.loads(data))


def local_region(runner) -> RankRegion:
    """This rank's KV shard (a page_major ``ModelRunner`` pool) as a RankRegion."""
    buf = runner.kv_pool.buffers()[0]
    lo, hi = runner.tp_shard.kv_heads if runner.tp_shard else (0, runner.num_kv_heads)
    rank = runner.tp.rank if runner.tp else 0
    return RankRegion(rank, lo, hi, buf.data_ptr(), buf.numel() * buf.element_size())


class WriteAgent:
    """A follower's side of P's KV writes (submits each command's puts, replies when they end) and
    of D's unblocking."""

    def __init__(self, engine, group, runner, staging_bytes: int):
        self.engine, self.group, self.runner = engine, group, runner
        self.me = local_region(runner)
        self.staging_bytes = staging_bytes
        self._writes: RankWrites | None = None  # built on the first write command (P only)
        self._waits = ThreadPoolExecutor(1, thread_name_prefix="tp-write-wait")

    def handle(self, payload: bytes) -> None:
        """``TPGroup.on_command``. A write's failure is its reply; an unblock that fails raises
        RuntimeError (this rank's pool would differ from what rank 0 commits: the rank exits)."""
        try:
            d = json.loads(payload)
            if is_accounting(d):  # rank 0 asks what this rank's pool and page table hold
                self.group.reply(answer(d, self.me.rank, self.runner, self.group.batches).encode())
                return
            if is_unblock(d):
                self._unblock(d)
                return
            if is_copy_pages(d):  # D forked a request: its samples' copies of the partial last page
                self._copy_pages(d)
                return
            if rank_checksums.is_head_sums(d):  # D's rank 0 checks pages of every rank's heads
                self.group.reply(rank_checksums.answer(d, self.me.rank, self.runner).encode())
                return
            cmd = WriteCommand.from_json(d)
        except (ValueError, TypeError, KeyError) as e:
            log.error("tensor-parallel rank %d: unreadable write command: %s", self.group.rank, e)
            return
        sums: tuple[list[int], list[list[int]]] = ([], [])
        try:
            if self.runner.device.type == "cuda":  # the forward's KV writes land before UCX reads them
                import torch

                torch.cuda.current_stream(self.runner.device).synchronize()
            if cmd.checksums:
                sums = self.written_sums(cmd)
            shape = PageShape(*cmd.shape)
            if self._writes is None:
                self._writes = RankWrites(self.engine, self.runner.kv_pool.region, self.me, shape,
                                          self.staging_bytes or DEFAULT_STAGING_MB << 20)
            targets = []
            for t in cmd.targets:
                desc = registry_pb2.SegmentDescriptor.FromString(bytes.fromhex(t.desc_hex))
                targets.append(Target(self.engine.open_segment(desc), RankRegion(*t.dst),
                                      RankWrite(self.me.rank, t.dst[0], t.head_start, t.head_end)))
            jid = self._writes.start(targets, cmd.src_pages, cmd.dst_pages, cmd.not_after)
        except Exception as e:  # SegmentClosed, DescriptorError, ValueError: say so to rank 0
            self._waits.submit(self._reply, WriteReply(cmd.id, False, f"rank {self.me.rank}: {e}"))
            return
        self._waits.submit(self._finish, cmd.id, jid, sums)

    def written_sums(self, cmd: WriteCommand) -> tuple[list[int], list[list[int]]]:
        """(global kv heads this command writes, ascending; ``sums[i][k]``: src page ``k``'s crc32
        for head ``i``), computed before the puts read the pages (they no longer change)."""
        heads = sorted({h for t in cmd.targets for h in range(t.head_start, t.head_end)})
        per_page = head_checksums(self.runner.kv_pool, cmd.src_pages, [h - self.me.head_start for h in heads])
        return heads, [[row[i] for row in per_page] for i in range(len(heads))]

    def _unblock(self, d: dict) -> None:
        try:
            unblock_pages(self.runner.kv_pool.region, d["pages"], d["blocks"])
        except (ValueError, TypeError, RuntimeError) as e:
            raise RuntimeError(f"tensor-parallel rank {self.me.rank}: cannot unblock KV pages: {e}") from None

    def _copy_pages(self, d: dict) -> None:
        import torch

        try:
            self.runner.kv_pool.copy_pages(torch.as_tensor(d["src"], dtype=torch.int64),
                                           torch.as_tensor(d["dst"], dtype=torch.int64))
        except (ValueError, TypeError, KeyError, RuntimeError, IndexError) as e:
            raise RuntimeError(f"tensor-parallel rank {self.me.rank}: cannot copy KV pages: {e}") from None

    def _finish(self, cid: int, jid: int, sums: tuple[list[int], list[list[int]]] = ([], [])) -> None:
        st = self._writes.wait(jid)
        puts, nbytes = self._writes.puts(jid)
        self._writes.release(jid)
        ok = st.state is State.COMPLETED
        self._reply(WriteReply(cid, ok, "" if ok else st.reason, puts if ok else 0, nbytes if ok else 0,
                               *(sums if ok else ([], []))))

    def _reply(self, reply: WriteReply) -> None:
        try:
            self.group.reply(reply.encode())
        except OSError:
            pass  # rank 0 is gone: this rank exits with the control pipe

    def close(self) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)
        if self._writes is not None:
            self._writes.close()


def _setup(group, runner, args):
    from transfer_svc.engine import TransferEngine

    cfg = AgentConfig(**json.loads(args.agent_config))
    loc = "cpu" if runner.device.type == "cpu" else f"cuda:{runner.device.index or 0}"
    engine = TransferEngine(f"{cfg.worker_id}#rank{group.rank}", transports=cfg.transports,
                            timeout_s=cfg.timeout_s, busy_poll=cfg.busy_poll)
    for buf in runner.kv_pool.buffers():
        engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size(), loc)
    group.reply(engine.publish().SerializeToString())
    agent = WriteAgent(engine, group, runner, cfg.staging_bytes)
    group.on_command = agent.handle

    def close():
        agent.close()
        engine.close()

    return close


def main(argv: list[str] | None = None) -> int:
    return run_follower(parse_args(argv, "pd_common.tp_rank"), _setup)


if __name__ == "__main__":
    sys.exit(main())

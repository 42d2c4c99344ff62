"""The ranks of one tensor-parallel engine: processes, their ``torch.distributed`` group, the batch
broadcast and the death watch.

Rank 0 is the engine the caller built (the face: scheduler, sampling, gRPC); it starts ranks
1..N-1 as child processes (``python -m engine.distributed.follower``) that build their shard of the
model and pool and then run every batch rank 0 runs. The group is gloo on CPU and NCCL on CUDA
(rank r on ``cuda:(base + r)``).

Each batch is announced on a pipe per follower (a 16-byte frame: op, message length), then its
description goes to every rank by one ``broadcast`` (``batch_wire``). A follower waits for the next
frame without a timeout (an idle engine sends nothing), and sees rank 0's death as the pipe's end
(the kernel closes it with the process). Collectives run under ``timeout_s``, so no rank waits for
a dead or stopped peer longer than that.

A worker's own per-rank work (under P/D disaggregation: its KV writes to a peer, rewriting received
pages, accounting queries) travels the same pipe as a *command* frame: opaque bytes that the follower hands to ``on_command`` in order with the
batches (so a write command sent after a forward reads what that forward wrote). Followers answer
on a reply pipe (length-prefixed bytes), which rank 0 reads on one thread per follower into
``replies(rank)``. A worker picks its own follower program (``FollowerSpec``), which runs the same
loop with its hooks.

A rank that exits takes the engine down: rank 0's watch thread sees the exit within 0.1 s, kills
the other followers (their sockets close, so a collective in flight fails at once instead of at
its timeout) and marks the group dead; the forward in flight and every later one raise
:class:`TPRankDied`, and ``on_rank_death`` (a worker stops itself there) is called once.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from engine.distributed.batch_wire import WireBatch, pack_batch, unpack_batch
from engine.forward_batch import ForwardBatch

log = logging.getLogger("halfmoon.engine.tp")

_FRAME = struct.Struct("<qq")  # (op, int64s in the broadcast message)
OP_STOP, OP_BATCH, OP_COMMAND = 0, 1, 2
_LEN = struct.Struct("<q")  # a reply's length
START_TIMEOUT_S = 600.0  # starting: imports and loading a shard, which a busy host slows down


@dataclass(frozen=True)
class FollowerSpec:
    """Which program ranks 1..N-1 run (``python -m <module> <standard flags> --agent-config
    <agent_config>``): the engine's follower, or a worker's own built on ``follower.run_follower``."""

    module: str = "engine.distributed.follower"
    agent_config: str = ""  # opaque to the engine: the follower program's own settings (JSON)


class TPRankDied(RuntimeError):
    """A tensor-parallel rank exited or a collective failed: this engine cannot run another forward."""


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cpu`` for every rank, ``cuda[:k]`` -> ``cuda:(k + rank)``."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def _init_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


class TPGroup:
    """One rank's view of the group. Build with :meth:`launch` (rank 0) or :meth:`join` (followers)."""

    def __init__(self, rank: int, size: int, device: torch.device, group: dist.ProcessGroup | None,
                 store: dist.Store, followers: list[subprocess.Popen] | None = None, pipes: list[int] | None = None,
                 control_fd: int | None = None, reply_fds: list[int] | None = None):
        self.rank, self.size, self.device, self.group = rank, size, device, group
        self._store = store
        self._parent = os.getppid() if control_fd is not None else None  # a follower's rank 0
        self.on_rank_death: Callable[[str], None] | None = None
        self._followers = followers or []
        self._pipes = pipes or []
        self._control = os.fdopen(control_fd, "rb", buffering=0) if control_fd is not None else None
        # follower: the reply pipe's write end; rank 0: one read end per follower
        self._reply_out = reply_fds[0] if control_fd is not None and reply_fds else None
        self._reply_lock = threading.Lock()
        self._reply_fds = reply_fds if control_fd is None and reply_fds else []
        self._replies: list[queue.Queue] = [queue.Queue() for _ in self._reply_fds]
        self.on_command: Callable[[bytes], None] | None = None  # a follower's handler of command frames
        self.batches = 0  # forwards run as the group (rank 0: sent); per-rank accounting compares them
        self.last_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # rank 0: last batch's (rows, seq_lens CPU)
        self._dead: str | None = None
        self._closing = threading.Event()
        self._watch = None

    def _start_watch(self) -> None:
        self._watch = threading.Thread(target=self._watch_followers, name="tp-watch", daemon=True)
        self._watch.start()
        for r, fd in enumerate(self._reply_fds, start=1):
            threading.Thread(target=self._read_replies, args=(fd, self._replies[r - 1]),
                             name=f"tp-replies-{r}", daemon=True).start()

    # ------------------------------------------------------------------ start
    @classmethod
    def launch(cls, config_json: dict, size: int, device: str, timeout_s: float,
               start_timeout_s: float = START_TIMEOUT_S, spec: FollowerSpec = FollowerSpec()) -> "TPGroup":
        """Rank 0: start ``size - 1`` follower processes (``spec``'s program) for the engine config
        ``config_json`` (``EngineConfig`` as a JSON-able dict) and form the group. Raises TPRankDied
        when a follower exits, or does not reach the group within ``start_timeout_s`` (imports on a
        loaded host)."""
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True,
                              timeout=datetime.timedelta(seconds=start_timeout_s), wait_for_workers=False)
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        followers, pipes, replies = [], [], []
        try:
            for r in range(1, size):
                rd, wr = os.pipe()
                reply_rd, reply_wr = os.pipe()
                cmd = [sys.executable, "-m", spec.module, "--rank", str(r), "--size", str(size),
                       "--store-port", str(store.port), "--control-fd", str(rd), "--reply-fd", str(reply_wr),
                       "--config", json.dumps(config_json), "--agent-config", spec.agent_config]
                followers.append(subprocess.Popen(cmd, pass_fds=(rd, reply_wr), env=env, cwd=root))
                os.close(rd)
                os.close(reply_wr)
                pipes.append(wr)
                replies.append(reply_rd)
            group = cls(0, size, rank_device(device, 0), None, store, followers, pipes, reply_fds=replies)
            group.barrier("joined", start_timeout_s)
            group.group = _init_group(store, 0, size, group.device, timeout_s)
        except BaseException:
            for p in followers:
                p.kill()
                p.wait()
            for fd in pipes + replies:
                os.close(fd)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        log.info("tensor parallel: %d ranks (followers %s), %s", size, [p.pid for p in followers],
                 "nccl" if group.device.type == "cuda" else "gloo")
        group._start_watch()
        return group

    @classmethod
    def join(cls, rank: int, size: int, store_port: int, control_fd: int, device: str, timeout_s: float,
             start_timeout_s: float = START_TIMEOUT_S, reply_fd: int | None = None) -> "TPGroup":
        """A follower: connect to rank 0's store and form the group."""
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=start_timeout_s))
        group = cls(rank, size, rank_device(device, rank), None, store, control_fd=control_fd,
                    reply_fds=[reply_fd] if reply_fd is not None else None)
        group.barrier("joined", start_timeout_s)
        group.group = _init_group(store, rank, size, group.device, timeout_s)
        return group

    def barrier(self, name: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every rank reached ``barrier(name)``, through the store (so a slow start, e.g.
        loading a shard on a busy host, is bounded by ``timeout_s`` and not by the collectives'
        timeout). Rank 0 fails fast (TPRankDied) when a follower exits meanwhile."""
        self._store.set(f"{name}/{self.rank}", b"1")
        keys = [f"{name}/{r}" for r in range(self.size)]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._store.check(keys):
                    return
            except (RuntimeError, dist.DistStoreError):  # rank 0's store is gone: the checks below say so
                pass
            exited = self._exited_follower()
            if self._parent is not None and os.getppid() != self._parent:
                exited = "tensor-parallel rank 0 exited"
            if exited is not None:
                raise TPRankDied(f"{exited} while the engine started")
            if time.monotonic() > deadline:
                raise TPRankDied(f"tensor-parallel ranks did not all reach {name!r} within {timeout_s:g} s")
            time.sleep(0.1)

    # ------------------------------------------------------------------ collectives
    def min_int(self, n: int) -> int:
        """The smallest ``n`` over all ranks (e.g. the pool pages every rank can hold)."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def run(self, forward: Callable[[], torch.Tensor], batch: ForwardBatch, logit_index: torch.Tensor | None,
            req_to_token: torch.Tensor, graph_bucket: int = 0) -> torch.Tensor:
        """Rank 0: send ``batch`` to the followers, then run ``forward`` (every rank runs it: the
        CUDA graph of ``graph_bucket`` when > 0, else the eager model; ``batch_wire.WireBatch``).

        Raises TPRankDied when the group is dead or a collective fails (the group is dead after).
        """
        if self._dead is not None:
            raise TPRankDied(self._dead)
        msg = pack_batch(batch, logit_index, req_to_token, graph_bucket)
        try:
            frame = _FRAME.pack(OP_BATCH, msg.numel())
            for fd in self._pipes:
                os.write(fd, frame)
            dist.broadcast(msg, src=0, group=self.group)
            self.batches += 1
            self.last_rows = (batch.req_pool_indices, batch.host_lens()[0])
            return forward()
        except (OSError, RuntimeError) as e:
            # a peer's death usually shows first as a reset socket: name the rank that exited if any
            reason = self._dead or self._exited_follower(wait_s=1.0) or \
                f"tensor-parallel collective failed: {str(e).splitlines()[0]}"
            self._fail(reason)
            raise TPRankDied(reason) from None

    def receive(self, req_to_token: torch.Tensor) -> WireBatch | None:
        """A follower: the next forward (its rows written into ``req_to_token``), or None when rank 0
        stops the group or is gone (the pipe ended). Command frames before it go to ``on_command``
        in order. Raises RuntimeError when the broadcast fails."""
        while True:
            frame = self._read_control(_FRAME.size)
            if frame is None:
                log.error("tensor-parallel rank %d: rank 0 went away; exiting", self.rank)
                return None
            op, n = _FRAME.unpack(frame)
            if op != OP_COMMAND:
                break
            payload = self._read_control(n)
            if payload is None or self.on_command is None:
                log.error("tensor-parallel rank %d: %s; exiting", self.rank,
                          "rank 0 went away" if payload is None else "a command frame but no handler")
                return None
            self.on_command(payload)
        if op == OP_STOP:
            return None
        msg = torch.empty(n, dtype=torch.int64, device=self.device)
        dist.broadcast(msg, src=0, group=self.group)
        self.batches += 1
        return unpack_batch(msg, req_to_token)

    def _read_control(self, n: int) -> bytes | None:
        """Exactly ``n`` bytes of the control pipe, or None when it ended first."""
        buf = b""
        while len(buf) < n:
            got = self._control.read(n - len(buf))
            if not got:
                return None
            buf += got
        return buf

    # ------------------------------------------------------------------ commands and replies
    def send_command(self, rank: int, payload: bytes) -> None:
        """Rank 0: queue ``payload`` for follower ``rank``'s ``on_command`` (after every batch sent
        before it). Call from the thread that runs the forwards. Raises TPRankDied when the group is
        dead or the follower's pipe is gone."""
        if self._dead is not None:
            raise TPRankDied(self._dead)
        try:
            os.write(self._pipes[rank - 1], _FRAME.pack(OP_COMMAND, len(payload)) + payload)
        except OSError:
            reason = self._exited_follower(wait_s=1.0) or f"tensor-parallel rank {rank}: its pipe is gone"
            self._fail(reason)
            raise TPRankDied(reason) from None

    def reply(self, payload: bytes) -> None:
        """A follower: send ``payload`` to rank 0 (``replies(rank)`` there). Thread-safe."""
        with self._reply_lock:
            os.write(self._reply_out, _LEN.pack(len(payload)) + payload)

    def replies(self, rank: int) -> queue.Queue:
        """Rank 0: follower ``rank``'s replies (bytes), in order; a reader thread fills it."""
        return self._replies[rank - 1]

    @staticmethod
    def _read_replies(fd: int, out: queue.Queue) -> None:
        with os.fdopen(fd, "rb", buffering=0) as f:
            while True:
                head = f.read(_LEN.size)
                if len(head) < _LEN.size:
                    return  # the follower exited: the watch thread reports it
                (n,) = _LEN.unpack(head)
                buf = b""
                while len(buf) < n:
                    got = f.read(n - len(buf))
                    if not got:
                        return
                    buf += got
                out.put(buf)

    # ------------------------------------------------------------------ death and shutdown
    @property
    def follower_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (rank 0 only; empty on a follower)."""
        return [p.pid for p in self._followers]

    @property
    def dead(self) -> str | None:
        """Why the group died (None while it is alive)."""
        return self._dead

    def _exited_follower(self, wait_s: float = 0.0) -> str | None:
        """Which follower exited (a sentence), waiting up to ``wait_s`` for one to; None if none did."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [(r, p, code) for r, p in enumerate(self._followers, start=1) if (code := p.poll()) is not None]
            if gone:
                # the watch thread may have named the first death meanwhile and killed the others (it
                # sets _dead before it kills): a follower dead by our own kill is not the cause
                if self._dead is not None:
                    return self._dead
                # a peer's death makes the others' collectives fail and them exit: a signal first
                r, p, code = min(gone, key=lambda g: (g[2] >= 0, g[0]))
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                return f"tensor-parallel rank {r} (pid {p.pid}) exited with {how}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _watch_followers(self) -> None:
        while not self._closing.wait(0.1):
            reason = self._exited_follower()
            if reason is not None:
                self._fail(reason)
                return

    def _fail(self, reason: str) -> None:
        if self._dead is not None or self._closing.is_set():
            return
        self._dead = reason
        log.error("%s: stopping the engine's other ranks", reason)
        for p in self._followers:
            if p.poll() is None:
                p.kill()
        if self.on_rank_death is not None:
            self.on_rank_death(reason)

    def kill(self) -> None:
        """Rank 0: kill the followers now (a start that failed half way). Idempotent."""
        self._closing.set()
        for p in self._followers:
            if p.poll() is None:
                p.kill()
            p.wait()
        for fd in self._pipes:
            os.close(fd)
        self._pipes = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self, timeout_s: float = 10.0) -> None:
        """Rank 0: stop the followers (then kill what did not exit in ``timeout_s``) and leave the group.
        A follower: leave the group. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        for fd in self._pipes:
            try:
                os.write(fd, _FRAME.pack(OP_STOP, 0))
            except OSError:
                pass  # that follower is gone already
            os.close(fd)
        self._pipes = []
        for p in self._followers:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()

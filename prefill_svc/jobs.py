"""A prefill request as the scheduler thread tracks it, and the destination D gave for it.

A job's path::

  QUEUED ─admit─> PREFILLING ─last chunk─> WAIT_DEST ─destination─> TRANSFERRING ─notice─> DONE
                    (a destination may be claimed at any stage; computed pages go as soon as it is)

Every field is read and written by the scheduler thread only, except ``reply``, which the gRPC
thread waits on.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from engine.grammar import GrammarState
from engine.sampling_params import SamplingParams
from pd_common.head_checksums import NoticeSums
from pd_common.protocol import ServiceError
from prefill_svc.kv_runs import PoolGeometry
from protos import prefill_pb2

if TYPE_CHECKING:
    from engine.kvcache.cache_manager import KVLease
    from transfer_svc.engine import Segment


class JobState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    WAIT_DEST = "waiting_destination"
    TRANSFERRING = "transferring"
    DONE = "done"


@dataclass(eq=False)
class Destination:
    """An accepted ``KVDestination`` with D's opened segment and D's pool geometry. ``not_after``:
    time.monotonic() seconds after which P starts no write into it (receipt + D's write window;
    None when D asked for no window)."""

    msg: prefill_pb2.KVDestination
    segment: Segment
    geometry: PoolGeometry
    not_after: float | None = None

    @property
    def room(self) -> int:
        return int(self.msg.room)


class PendingBatch(NamedTuple):
    """One submitted batch of a job's pages that the transfer engine has not finished."""

    submitted: float  # time.monotonic() seconds at submit
    pages: int        # pages the batch writes
    nbytes: int       # bytes the batch writes
    per_rank: bool = False  # a RankWriter batch (P or D tensor-parallel), not one engine batch
    first_page: int = 0     # the logical page its first page is (its checksums' place in the notice)


class FirstToken(NamedTuple):
    """The token sampled from the prompt's last logits."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass(eq=False)
class PrefillJob:
    """One request: its prompt, its KV lease on P, its destination on D and its progress.

    Token counts are tokens; ``next_page`` is a logical page index (page i holds tokens
    ``[i * page_size, (i + 1) * page_size)``); times are ``time.monotonic()`` seconds (0: not yet).
    """

    request_id: str
    room: int
    prompt_ids: list[int]
    params: SamplingParams
    grammar: GrammarState | None = None  # structured output: constrains the first token
    n: int = 1                     # samples of the prompt (PrefillRequest.n): n first tokens, one logits row
    sample_grammars: list[GrammarState | None] = field(default_factory=list)  # samples 1..n-1's matchers
    arrived: float = field(default_factory=time.monotonic)
    # how long it may wait for D's destination: the Prefill call's own deadline (D may queue the
    # request under memory pressure for longer than any fixed timeout), else --destination-timeout
    destination_deadline: float | None = None
    reply: Future = field(default_factory=Future)  # -> prefill_pb2.PrefillResult | ServiceError
    state: JobState = JobState.QUEUED
    lease: KVLease | None = None   # P's row and pages, from admission until release
    pre_len: int = 0               # P's prefix-cache hit (page-aligned)
    computed: int = 0              # tokens whose KV is in P's pool
    dest: Destination | None = None
    next_page: int = 0             # next logical page to send
    batches: dict[int, PendingBatch] = field(default_factory=dict)  # batch id -> pending batch
    notify_id: int | None = None   # the ok notice's id while the transfer engine holds it
    pages_sent: int = 0            # pages of completed batches
    sums: NoticeSums | None = None  # checksums of completed rank batches (tensor-parallel pair, asked)
    bytes_sent: int = 0
    first: FirstToken | None = None
    rng_state: bytes = b""         # the sampler's generator state after the first token (seeded)
    samples: list[prefill_pb2.FirstSample] = field(default_factory=list)  # samples 1..n-1's first tokens
    error: ServiceError | None = None
    aborted: str = ""              # the abort reason
    notified_ok: bool = False      # D received the ok notice, so no ok=false notice may follow
    t_admit: float = 0.0
    t_prefilled: float = 0.0
    t_transfer: float = 0.0

    @property
    def busy(self) -> bool:
        """Some write of this job may still read its pages (they must stay allocated)."""
        return bool(self.batches) or self.notify_id is not None

    @property
    def failed(self) -> bool:
        """The job is ending without success (error or abort); it ends once it is not busy."""
        return self.error is not None or bool(self.aborted)


class JobEnds(Protocol):
    """How a part of the scheduler ends a job (the scheduler implements it)."""

    def succeed(self, job: PrefillJob) -> None:
        """D has the KV and the ok notice: release the job, answer its caller."""

    def fail(self, job: PrefillJob, err: ServiceError) -> None:
        """Record ``err`` (the first error wins); the job ends once it is not busy."""

    def finish_failed(self, job: PrefillJob) -> None:
        """End a failed, idle job: ok=false notice to D, release, answer the caller."""

"""A decode request on D and the states it passes through.

    PREALLOC ─row+pages─> TRANSFER ─P's notice ok─> WAITING ─batch slot─> RUNNING ─finish─> DONE
                                                      ^   ^                      │
    LOCAL_PREFILL ─tail computed, first token sampled─┘   └─resume── RETRACTED <─┘ pool short

    n > 1: TRANSFER ─P's notice ok─> FORKED ─last sample ended─> DONE (each sample runs from WAITING)

Each state but DONE is one queue that owns the job: ``PreallocQueue`` (PREALLOC), ``KVWaitQueue``
(TRANSFER), ``RunningBatch`` (WAITING and RUNNING), ``DecodeMemory`` (RETRACTED),
``LocalPrefillQueue`` (LOCAL_PREFILL: no prefill leg, D computes the prompt's uncached tail). Any state may end
early (abort, timeout, P's failure); only a TRANSFER job can leave pages behind that P may still write (the quarantine).
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.kvcache.cache_manager import CacheManager, KVLease
from engine.grammar import GrammarState
from engine.sampling_params import SamplingParams


class JobState(enum.Enum):
    PREALLOC = "prealloc"  # waiting for a row and KV pages
    TRANSFER = "transfer"  # destination sent to P, waiting for P's notice
    WAITING = "waiting"    # prompt KV committed, waiting for a slot in the decode batch
    RUNNING = "running"    # in the decode batch
    RETRACTED = "retracted"  # pool short: KV given back (full pages kept by the radix cache), waits to
    # resume; holds a lease again while D recomputes its tail (DecodeMemory.resuming)
    LOCAL_PREFILL = "local_prefill"  # no P leg: waiting for a row, or D computing the uncached tail
    FORKED = "forked"      # n > 1: its samples run (decode_svc/fork.py); holds no KV itself
    DONE = "done"


class DestState(enum.Enum):
    """Where the ``KVDestination`` sent to P stands: decides whether P may still write D's pages."""

    NONE = "none"            # not sent (pre-allocation)
    SENDING = "sending"      # SetDestination in flight: P may have taken it
    ACCEPTED = "accepted"    # P took it and answers it with exactly one notice
    REJECTED = "rejected"    # P answered a definite error: it holds nothing for the room
    UNKNOWN = "unknown"      # timeout / unreachable: P may or may not hold it
    PEER_GONE = "peer_gone"  # P's segment incarnation is gone: nothing of it writes any more
    ANSWERED = "answered"    # P's notice arrived: P writes nothing more

    @property
    def may_write(self) -> bool:
        """Whether P may still write into the destination pages."""
        return self in (DestState.SENDING, DestState.ACCEPTED, DestState.UNKNOWN)


@dataclass(eq=False)
class DecodeJob:
    """One request's decode leg.

    ``out`` carries what the gRPC thread streams: ``decode_pb2.DecodeChunk`` items, then ``None``
    (finished) or one ``ServiceError`` (failed). ``lease`` is the request's KV (row
    ``[prefix slots | delta slots | decode slots]``; ``lease.pre_len`` tokens came from D's radix
    cache), None before pre-allocation and after release. ``dst_pages``: the delta's page ids sent
    to P (logical pages ``pre_len / page_size`` onwards). ``kv_len``: tokens whose K/V the row holds.
    """

    request_id: str
    room: int
    prompt_ids: list[int]
    params: SamplingParams
    prefill_address: str
    prefill_worker_id: str = ""    # optional (router): P's segment name, for liveness before P answers
    local_prefill: bool = False    # D prefills the prompt itself (DecodeRequest.local_prefill)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    state: JobState = JobState.PREALLOC
    seq: int = 0                   # arrival order on the scheduler thread (batch order)
    detok: object = None           # engine.detokenizer.IncrementalDetokenizer when stop strings are set
    lease: KVLease | None = None
    dst_pages: list[int] = field(default_factory=list)
    dest_state: DestState = DestState.NONE
    prefill_segment: str = ""
    prefill_incarnation: str = ""
    prefill_process: object = None  # messages.ProcessId of P, from its descriptor, when known
    t_prealloc: float = 0.0        # time.monotonic() of the pre-allocation
    fence_at: float = 0.0          # time.monotonic() after which P can start no write (quarantine)
    kv_len: int = 0
    retractions: int = 0           # times the pool ran short and this job gave its KV back
    output_ids: list[int] = field(default_factory=list)
    generator: object = None       # torch.Generator for non-greedy sampling
    grammar: GrammarState | None = None  # structured output; P's first token is replayed into it
    cached_tokens: int = 0         # P's own prefix-cache hit (D's with local_prefill)
    pages_transferred: int = 0
    bytes_transferred: int = 0
    finish_reason: str = ""
    matched_stop: str = ""
    aborted: str = ""
    n: int = 1                     # samples of the prompt (DecodeRequest.n; decode_svc/fork.py)
    index: int = 0                 # this job's sample index (a forked sample's DecodeChunk.index)
    sample_grammars: list[GrammarState | None] = field(default_factory=list)  # samples 1..n-1's matchers
    first_samples: list = field(default_factory=list)   # KVNotice.samples, from the commit to the fork
    sample_aborts: set[int] = field(default_factory=set)  # samples aborted before the fork

    def kv_tokens(self) -> list[int]:
        """The tokens whose K/V the row holds: ``(prompt + output)[:kv_len]``."""
        return (self.prompt_ids + self.output_ids)[: self.kv_len]

    def release_kv(self, kv: CacheManager, *, keep_tokens: bool = True,
                   withhold: Collection[int] = ()) -> None:
        """Give the lease back (no-op without one).

        Args:
            keep_tokens: the radix cache may keep the full pages of ``kv_tokens()``; False when the
                row's K/V cannot be trusted (P may still write into it).
            withhold: own pages not to free (the quarantine takes them over).
        """
        if self.lease is None:
            return
        kv.release(self.lease, self.kv_tokens() if keep_tokens else None, withhold)
        self.lease = None

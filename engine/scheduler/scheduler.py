"""Continuous-batching scheduler for the co-located engine (the reference the PD path is compared
against). Drives a :class:`~engine.model_runner.ModelRunner`; does not tokenize.

Each :meth:`Scheduler.step` runs one forward:

* **extend** when prefill work exists: first the next chunk of requests already prefilling, then
  new requests admitted from the waiting queue (FIFO) while the chunked-prefill token budget, the
  request rows and the pool allow. Admission matches the prompt in the radix cache (all but the last
  token, so one token is always computed), locks the prefix, evicts unlocked pages when short, and
  allocates the rest of the sequence; it keeps one page of headroom per running request so the next
  decode step does not have to preempt at once.
* **decode** otherwise: one token for every running request; when the pool is short even after
  eviction, a request is preempted, chosen by the policy the decode worker's retraction shares
  (``engine.scheduler.retraction.pick_victim``: the newest not yet preempted ``max_retractions``
  times), its
  committed tokens go to the radix cache, its pages are freed, and it re-enters the waiting queue
  at the front, resuming with prompt + output.

A finished request inserts its committed tokens (prompt + outputs whose K/V exists; the last
sampled token has none) into the radix cache, frees duplicate and tail pages, unlocks its prefix
and frees its row (recipe of ``engine/kvcache/radix_cache.py``). With ``disable_radix_cache`` it frees all.
Accounting invariant after every step: free + evictable + protected + owned pages == pool pages.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from engine.config import EngineConfig
from engine.errors import ResourceExhaustedError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner
from engine.kvcache.cache_manager import CacheManager
from engine.kvcache.prefix_cache import NullPrefixCache
from engine.kvcache.radix_cache import RadixCache
from engine.scheduler.request import FinishReason, Req
from engine.scheduler.retraction import pick_victim
from engine.sampler import sample


@dataclasses.dataclass
class StepResult:
    req: Req
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclasses.dataclass(frozen=True)
class KVStats:
    """KV accounting (pages unless named slots/rows). free + evictable + protected + owned == num_pages."""

    num_pages: int
    page_size: int
    free_pages: int
    evictable_pages: int
    protected_pages: int
    owned_pages: int  # pages running requests hold outside the radix cache
    rows_in_use: int
    slots_in_use: int  # tokens allocated in rows (sum of alloc_len)
    running: int
    waiting: int


class Scheduler:
    """The co-located engine's scheduler (see the module docstring).

    Raises:
        ValueError: ``config.max_retractions`` < 0.
    """

    def __init__(self, runner: ModelRunner, config: EngineConfig, eos_token_ids: set[int]):
        if config.max_retractions < 0:
            raise ValueError(f"max_retractions must be >= 0, got {config.max_retractions}")
        self.runner = runner
        self.config = config
        self.alloc = runner.allocator
        self.r2t = runner.req_to_token_pool
        self.ps = runner.page_size
        self.cache = NullPrefixCache() if config.disable_radix_cache else RadixCache(self.ps, self.alloc)
        self.kv = CacheManager(self.alloc, self.r2t, self.cache)
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.prefilling: set[Req] = set()
        self._arrivals = 0

    # ------------------------------------------------------------------ queue
    def check_fits(self, seq_len: int) -> None:
        """Raise ResourceExhaustedError when ``seq_len`` tokens (prompt + max_tokens) exceed the pool."""
        need = self.alloc.pages_needed(0, seq_len)
        if need > self.alloc.num_pages:
            raise ResourceExhaustedError(
                f"request needs {need} KV pages ({seq_len} tokens) but the pool has {self.alloc.num_pages}")

    def add(self, req: Req) -> None:
        self.check_fits(len(req.prompt_ids) + req.params.max_tokens)
        self._arrivals += 1
        req.arrival = self._arrivals
        self.waiting.append(req)

    def abort(self, request_id: str) -> Req | None:
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.finish_reason = FinishReason.ABORT
                return r
        for r in self.running:
            if r.request_id == request_id:
                self.finish(r, FinishReason.ABORT)
                return r
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ memory
    def _admit(self, req: Req) -> bool:
        ids = req.all_ids
        lease = self.kv.admit(ids, match_len=len(ids) - 1, alloc_len=len(ids),
                              headroom_pages=len(self.running))
        if lease is None:
            return False
        req.lease, req.kv_len = lease, lease.pre_len
        if req.cached_tokens is None:
            req.cached_tokens = min(lease.pre_len, len(req.prompt_ids))
        return True

    def _release(self, req: Req) -> None:
        """Give back everything ``req`` holds (radix insert of committed tokens, unlock, free)."""
        if req.lease is None:
            return
        self.kv.release(req.lease, req.all_ids[:req.kv_len])
        req.lease, req.kv_len = None, 0

    def _preempt(self, req: Req) -> None:
        self._release(req)
        self.running.remove(req)
        self.prefilling.discard(req)
        req.preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Req, reason: FinishReason, stop_str: str | None = None) -> None:
        """End a running request (idempotent) and free what it holds."""
        if req.finish_reason is None:
            req.finish_reason = reason
            req.stop_str = stop_str
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        self.prefilling.discard(req)

    # ------------------------------------------------------------------ schedule
    def _schedule_extend(self) -> list[tuple[Req, int]]:
        budget = self.config.chunked_prefill_size
        chosen: list[tuple[Req, int]] = []
        for r in self.running:
            if r in self.prefilling and budget > 0:
                n = min(r.pending, budget)
                chosen.append((r, n))
                budget -= n
        while (budget > 0 and self.waiting and self.r2t.num_free > 0
               and len(self.running) < self.config.max_running_requests):
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            self.prefilling.add(req)
            n = min(req.pending, budget)
            chosen.append((req, n))
            budget -= n
        return chosen

    def _schedule_decode(self) -> list[tuple[Req, int]]:
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running:
                continue  # preempted meanwhile
            while not self.kv.grow(req.lease, req.seq_len):
                victim, _ = pick_victim(self.running, arrival=lambda r: r.arrival,
                                        retractions=lambda r: r.preemptions,
                                        max_retractions=self.config.max_retractions)
                self._preempt(victim)
                if victim is req:
                    break
        return [(r, 1) for r in self.running]

    # ------------------------------------------------------------------ step
    def step(self) -> list[StepResult]:
        """Run one forward (extend if prefill work exists, else decode); sample finished prefills
        and decodes; finish requests on EOS / stop token / max_tokens / context window."""
        work = self._schedule_extend()
        mode = ForwardMode.EXTEND
        if not work:
            work = self._schedule_decode()
            mode = ForwardMode.DECODE
        if not work:
            if self.waiting and not self.running:
                # defensive (add() rejects what can never fit): fail the head rather than spin
                req = self.waiting.popleft()
                req.finish_reason = FinishReason.ABORT
                req.error = f"request {req.request_id} cannot be admitted into an idle pool"
                return [StepResult(req, -1, None, None)]
            return []
        rows, pres, toks, locs = [], [], [], []
        for req, n in work:
            rows.append(req.lease.row)
            pres.append(req.kv_len)
            toks.append(req.all_ids[req.kv_len:req.kv_len + n])
            locs.append(self.r2t.req_to_token[req.lease.row, req.kv_len:req.kv_len + n])
        batch = ForwardBatch.build(mode, rows, pres, toks, torch.cat(locs), self.runner.device)
        logits = self.runner.forward(batch)
        done_idx, done = [], []
        for i, (req, n) in enumerate(work):
            req.kv_len += n
            if req.kv_len == req.seq_len:
                done_idx.append(i)
                done.append(req)
        if not done:
            return []
        out = sample(logits[done_idx], [r.params for r in done], [r.generator for r in done],
                     [r.prompt_ids for r in done], [r.output_ids for r in done], [r.grammar for r in done])
        results = []
        max_ctx = self.runner.max_context
        for j, req in enumerate(done):
            tok = out.token_ids[j]
            req.output_ids.append(tok)
            self.prefilling.discard(req)
            results.append(StepResult(req, tok, out.logprobs[j], out.top_logprobs[j]))
            p = req.params
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids) \
                    or (req.grammar is not None and req.grammar.terminated):
                self.finish(req, FinishReason.STOP)
            elif len(req.output_ids) >= p.max_tokens or req.seq_len >= max_ctx:
                self.finish(req, FinishReason.LENGTH)
        return results

    # ------------------------------------------------------------------ accounting
    def kv_stats(self) -> KVStats:
        owned = sum(len(r.lease.own_pages) for r in self.running)
        return KVStats(
            num_pages=self.alloc.num_pages, page_size=self.ps, free_pages=self.alloc.num_free,
            evictable_pages=self.cache.evictable_size(), protected_pages=self.cache.protected_size(),
            owned_pages=owned, rows_in_use=self.r2t.num_used,
            slots_in_use=sum(r.lease.alloc_len for r in self.running),
            running=len(self.running), waiting=len(self.waiting))

    def check_invariants(self, expect_idle: bool = False) -> KVStats:
        """Assert the accounting invariant (and, when idle, no rows held and all locks zero)."""
        s = self.kv_stats()
        total = s.free_pages + s.evictable_pages + s.protected_pages + s.owned_pages
        assert total == s.num_pages, f"KV accounting broken: {s}"
        if self.cache.enabled:
            self.cache.check_invariants(num_pages=s.num_pages, free_pages=s.free_pages,
                                        owned_pages=s.owned_pages, expect_unlocked=expect_idle)
        if expect_idle:
            assert s.rows_in_use == 0 and s.running == 0, f"not idle: {s}"
        return s

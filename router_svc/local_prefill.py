"""Conditional disaggregation: when to send a request to a decode worker alone, which prefills the
prompt's uncached tail itself (docs/architecture.md, A request's path; Dynamo's conditional
disaggregation, ``isl_bounding`` and ``prefill_load``, decides the same on its decode side).

For a prompt of ``L`` tokens, D's hit is what the router's KV-event index says D's radix cache holds
(whole pages, at most ``L - 1`` tokens: D computes the last token's logits itself) and its *tail*
``L - hit``. Among available decode workers, the one with the shortest tail (then the lowest load)
serves the request alone when

* ``short_tail``: its tail is at most ``max_tail_tokens``: a follow-up turn of a chat, or a short
  prompt no D holds anything of (hit 0, tail ``L``). This is Dynamo's ``max_local_prefill_length``
  rule (prefill remotely only when the uncached length exceeds it): a short prompt then skips the
  P hop, the destination round trip and the KV transfer (~10 ms of a 193-token prompt's TTFT at
  c=1 on CPU, bench/README.md "TTFT at c=1") and leaves P free for long ones, or
* ``prefill_queue``: every available prefill worker has at least ``prefill_queue`` requests queued
  or running (``GetLoad`` plus dispatched since) and that D holds at least one page of the prompt
  (a D holding nothing would compute a prompt of any length inside its decode loop).

Every request field works on this path (D samples the first token with the same sampler P uses), so
no field forces PD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router_svc.kv_index import KVEventIndex
from router_svc.prefix_index import page_keys
from router_svc.worker import Worker
from telemetry import metrics as M


@dataclass(frozen=True)
class LocalChoice:
    """The decode worker that prefills alone, why (:data:`telemetry.metrics.LOCAL_PREFILL_REASONS`)
    and the tail (tokens) the index predicts it computes."""

    decode: Worker
    reason: str
    tail_tokens: int


class LocalPrefillPolicy:
    """Decides per attempt whether D prefills alone (see the module docstring).

    Args:
        index: the router's per-worker page index (``--policy kv_events``).
        page_size: tokens per page.
        max_tail_tokens: ``--local-prefill-max-tokens`` (0: never for a short tail).
        prefill_queue: ``--local-prefill-queue`` (0: never for the prefill queue).
    Raises:
        ValueError: a negative threshold, or both 0 (the policy would never act).
    """

    def __init__(self, index: KVEventIndex, page_size: int, *, max_tail_tokens: int = 0,
                 prefill_queue: int = 0) -> None:
        if max_tail_tokens < 0 or prefill_queue < 0:
            raise ValueError("--local-prefill-max-tokens and --local-prefill-queue must be >= 0")
        if not (max_tail_tokens or prefill_queue):
            raise ValueError("local prefill needs --local-prefill-max-tokens or --local-prefill-queue > 0")
        self.index = index
        self.page_size = page_size
        self.max_tail_tokens = max_tail_tokens
        self.prefill_queue = prefill_queue

    def choose(self, prefills: Sequence[Worker], decodes: Sequence[Worker], input_ids: list[int],
               exclude: set[str] = frozenset()) -> LocalChoice | None:
        """The decode worker that serves ``input_ids`` alone, or None (the PD way). Workers in
        ``exclude`` (a failed attempt's) are never chosen."""
        n, ps = len(input_ids), self.page_size
        keys = page_keys(input_ids, ps)
        cap = max(n - 1, 0) // ps * ps
        best: tuple[int, float, str, Worker] | None = None
        for d in decodes:
            if not d.available or d.worker_id in exclude:
                continue
            hit = min(self.index.matched_pages(d.worker_id, keys) * ps, cap)
            cand = (n - hit, d.load_score(), d.worker_id, d)
            best = cand if best is None or cand[:3] < best[:3] else best
        if best is None:
            return None
        tail, _, _, d = best
        if self.max_tail_tokens and tail <= self.max_tail_tokens:
            reason = "short_tail"
        elif self.prefill_queue and tail < n and self._prefill_busy(prefills):
            reason = "prefill_queue"
        else:
            return None
        d.dispatched_since_report += 1
        M.ROUTER_LOCAL_PREFILLS.labels(reason=reason).inc()
        return LocalChoice(d, reason, tail)

    def _prefill_busy(self, prefills: Sequence[Worker]) -> bool:
        up = [p for p in prefills if p.available]
        return bool(up) and all(p.load_score() >= self.prefill_queue for p in up)

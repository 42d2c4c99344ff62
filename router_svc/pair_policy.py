"""Joint choice of the (prefill, decode) pair from the workers' KV events (``--policy kv_events``;
docs/architecture.md, Router).

For a prompt of ``L`` tokens (``n = ceil(L / page_size)`` pages, chained keys ``k``) and every
available pair whose KV pools match::

    cost(P, D) = prefill_token * (L - P's hit)              P's hit: whole pages, at most L - 1 tokens
               + transfer_mib  * (n - D's hit pages) * page_bytes / MiB      the delta P writes to D
               + prefill_load  * P.load_score()  + decode_load * D.load_score()

Hits come from :class:`router_svc.kv_index.KVEventIndex` (exact, from the workers' events); loads
from ``GetLoad`` plus the requests dispatched since. The cheapest pair wins; among equals, the pair caching the fewest pages, then round robin.
The terms are in "prefill tokens": with the defaults a queued request on P costs as much as
computing 64 prompt tokens, one on D as much as 8, and moving one MiB of KV as computing one token.
Pages of a worker whose layout is unknown (static list) count as 1 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from router_svc.kv_index import KVEventIndex
from router_svc.policies import NoWorkerError
from router_svc.prefix_index import page_keys
from router_svc.worker import Worker, kv_compatible, kv_mismatch

MIB = float(1 << 20)


@dataclass(frozen=True)
class PairWeights:
    """Weights of the cost terms (router flags ``--kv-*-weight``), all >= 0."""

    prefill_token: float = 1.0
    transfer_mib: float = 1.0
    prefill_load: float = 64.0
    decode_load: float = 8.0

    def __post_init__(self) -> None:
        for name, v in vars(self).items():
            if not v >= 0:
                raise ValueError(f"--kv-{name.replace('_', '-')}-weight must be >= 0, got {v}")


@dataclass(frozen=True)
class PairCost:
    """Why a pair was chosen: tokens P computes, pages and bytes D receives, and the total."""

    prefill_tokens: int
    delta_pages: int
    delta_bytes: int
    total: float


class KVPairPolicy:
    """Picks P and D together (see the module docstring).

    Args:
        index: the router's per-worker page index (fed by ``router_svc.kv_subscriber``).
        page_size: tokens per page (the workers' ``--page-size``).
        weights: the cost weights.
    """

    name = "kv_events"

    def __init__(self, index: KVEventIndex, page_size: int = 16, weights: PairWeights = PairWeights()) -> None:
        self.index = index
        self.page_size = page_size
        self.weights = weights
        self._rr = 0
        self.last_cost: PairCost | None = None

    def forget(self, worker_id: str) -> None:
        self.index.forget(worker_id)

    def cost(self, p: Worker, d: Worker, keys: list[int], prompt_len: int) -> PairCost:
        """The cost of serving a prompt (``keys`` its chained page keys) on ``p`` then ``d``."""
        ps, w = self.page_size, self.weights
        p_hit = min(self.index.matched_pages(p.worker_id, keys) * ps, max(prompt_len - 1, 0) // ps * ps)
        pages = -(-prompt_len // ps)
        delta = pages - min(self.index.matched_pages(d.worker_id, keys), pages)
        delta_bytes = delta * (d.kv_page_bytes or p.kv_page_bytes or int(MIB))
        total = (w.prefill_token * (prompt_len - p_hit) + w.transfer_mib * delta_bytes / MIB
                 + w.prefill_load * p.load_score() + w.decode_load * d.load_score())
        return PairCost(prompt_len - p_hit, delta, delta_bytes, total)

    def pick(self, prefills: Sequence[Worker], decodes: Sequence[Worker], input_ids: list[int],
             exclude: set[str] = frozenset()) -> tuple[Worker, Worker]:
        """The cheapest available pair, avoiding workers in ``exclude`` when others are available.

        Raises:
            NoWorkerError: no available worker of a role, or no pair whose KV pools match (the
                message names the fields that differ and their flags).
        """
        ps_ = _prefer([w for w in prefills if w.available], exclude)
        ds_ = _prefer([w for w in decodes if w.available], exclude)
        if not ps_:
            raise NoWorkerError(f"no healthy prefill worker ({len(prefills)} registered)")
        if not ds_:
            raise NoWorkerError(f"no healthy decode worker ({len(decodes)} registered)")
        pairs = [(p, d) for p in ps_ for d in ds_ if kv_compatible(p, d)]
        if not pairs:
            p, d = ps_[0], ds_[0]
            raise NoWorkerError(f"no decode worker's KV pool matches a prefill worker's: {p.worker_id} vs "
                                f"{d.worker_id}: {kv_mismatch(p, d)}; prefill and decode workers need the same flags")
        keys = page_keys(input_ids, self.page_size)
        costs = [(self.cost(p, d, keys, len(input_ids)), p, d) for p, d in pairs]
        best = min(c.total for c, _, _ in costs)
        ties = [(c, p, d) for c, p, d in costs if c.total == best]
        # a prefix nobody holds goes where least is cached, so new conversations spread out
        least = min(self.index.size(p.worker_id) + self.index.size(d.worker_id) for _, p, d in ties)
        ties = [t for t in ties if self.index.size(t[1].worker_id) + self.index.size(t[2].worker_id) == least]
        cost, p, d = ties[self._rr % len(ties)]
        self._rr += 1
        p.dispatched_since_report += 1
        d.dispatched_since_report += 1
        self.last_cost = cost
        return p, d


def _prefer(workers: list[Worker], exclude: set[str]) -> list[Worker]:
    """``workers`` not in ``exclude``, or all of them when that leaves none; in id order."""
    kept = [w for w in workers if w.worker_id not in exclude]
    return sorted(kept or workers, key=lambda w: w.worker_id)

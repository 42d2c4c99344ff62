"""Routing policies; the router holds one for prefill and one for decode (SMG #8395).

Every policy picks only among ``available`` workers (healthy, not removed) and raises
:class:`NoWorkerError` when there is none. Names and semantics follow SMG
(``model_gateway/src/policies/`` in lightseekorg/smg):

- ``round_robin``: next available worker in id order.
- ``least_load``: smallest :meth:`Worker.load_score` (``GetLoad`` waiting + running + transferring,
  plus dispatches since the report); ties go round robin.
- ``power_of_two``: two distinct random workers, keep the less loaded.
- ``cache_aware``: the worker whose recent prompts share the longest page-aligned prefix with this
  one, when ``matched / prompt_tokens > cache_threshold``; otherwise, or when load is imbalanced
  (``max - min > balance_abs`` and ``max > balance_rel * min``), the least loaded.
"""

from __future__ import annotations

import random
from typing import Sequence

from router_svc.prefix_index import PrefixIndex, page_keys
from router_svc.worker import Worker

POLICY_NAMES = ("round_robin", "least_load", "power_of_two", "cache_aware")


class NoWorkerError(RuntimeError):
    """No available worker of the wanted role."""


class Policy:
    """Base: filters to available workers, then :meth:`choose` picks one."""

    name = "base"

    def __init__(self) -> None:
        self._rr = 0

    def pick(self, workers: Sequence[Worker], input_ids: list[int]) -> Worker:
        """Pick a worker for a prompt.

        Args:
            workers: candidate workers (any health; unavailable ones are skipped).
            input_ids: the prompt token ids.

        Raises:
            NoWorkerError: no candidate is available.
        """
        cands = sorted((w for w in workers if w.available), key=lambda w: w.worker_id)
        if not cands:
            raise NoWorkerError("no healthy worker")
        chosen = self.choose(cands, input_ids)
        chosen.dispatched_since_report += 1
        return chosen

    def choose(self, cands: list[Worker], input_ids: list[int]) -> Worker:
        raise NotImplementedError

    def forget(self, worker_id: str) -> None:
        """Drop per-worker state of a removed worker."""

    def _round_robin(self, cands: list[Worker]) -> Worker:
        w = cands[self._rr % len(cands)]
        self._rr += 1
        return w

    def _least_loaded(self, cands: list[Worker]) -> Worker:
        best = min(w.load_score() for w in cands)
        return self._round_robin([w for w in cands if w.load_score() == best])


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, cands, input_ids):
        return self._round_robin(cands)


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, cands, input_ids):
        return self._least_loaded(cands)


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, cands, input_ids):
        if len(cands) == 1:
            return cands[0]
        a, b = self._rng.sample(cands, 2)
        return a if a.load_score() <= b.load_score() else b


class CacheAware(Policy):
    """Prefix-affinity routing with a load-balance escape hatch (SMG ``cache_aware.rs``).

    Args:
        page_size: tokens per page; prefixes match in whole pages, like the workers' radix caches.
        cache_threshold: minimum ``matched_tokens / prompt_tokens`` to follow the prefix (SMG: 0.3).
        balance_abs: load gap (requests) above which load wins over affinity (SMG: 64; ours is
            smaller because CPU workers run few requests at once).
        balance_rel: and the most loaded must exceed ``balance_rel`` x the least loaded (SMG: 1.5).
        max_pages: per-worker index capacity in pages.
    """

    name = "cache_aware"

    def __init__(self, page_size: int = 16, cache_threshold: float = 0.3, balance_abs: float = 8,
                 balance_rel: float = 1.5, max_pages: int = 1 << 16) -> None:
        super().__init__()
        self.page_size = page_size
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_pages = max_pages
        self._index: dict[str, PrefixIndex] = {}

    def index(self, worker_id: str) -> PrefixIndex:
        if worker_id not in self._index:
            self._index[worker_id] = PrefixIndex(self.page_size, self.max_pages)
        return self._index[worker_id]

    def imbalanced(self, cands: list[Worker]) -> bool:
        loads = [w.load_score() for w in cands]
        return max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads)

    def choose(self, cands, input_ids):
        keys = page_keys(input_ids, self.page_size)
        if self.imbalanced(cands):
            chosen = self._least_loaded(cands)
        else:
            matches = [(self.index(w.worker_id).match(keys), w) for w in cands]
            best_len = max(m for m, _ in matches)
            if input_ids and best_len / len(input_ids) > self.cache_threshold:
                chosen = self._least_loaded([w for m, w in matches if m == best_len])
            else:
                low = min(w.load_score() for w in cands)
                least = [w for w in cands if w.load_score() == low]
                smallest = min(len(self.index(w.worker_id)) for w in least)
                chosen = self._round_robin([w for w in least if len(self.index(w.worker_id)) == smallest])
        self.index(chosen.worker_id).insert(keys)
        return chosen

    def forget(self, worker_id: str) -> None:
        self._index.pop(worker_id, None)


def make_policy(name: str, page_size: int = 16, seed: int | None = None) -> Policy:
    """Build a policy by name (one of :data:`POLICY_NAMES`).

    Raises:
        ValueError: unknown name.
    """
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    if name == "cache_aware":
        return CacheAware(page_size=page_size)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")

"""The halfmoon metric catalog: every Prometheus metric of every service, defined once.

Services import the objects they own from here (``from telemetry import metrics as M``) and update
them; nothing else defines metrics. The definitions live per owner in ``telemetry/<owner>_metrics.py``
(label values in ``label_values.py``, buckets in ``buckets.py``, exposition in ``exposition.py``);
this module keeps every public name importable in one place and documents the catalog. Each quantity
is counted by exactly one service (its *owner*), so a PromQL ``sum(...)`` over all scrape targets
never double-counts. Names follow Prometheus conventions: prefix ``halfmoon_<owner>_``, base units
in the name (``_seconds``, ``_bytes``, ``_tokens``, ``_pages``, ``_ratio``), counters end in
``_total``.

Exposition and labels
---------------------
Each process serves ``/metrics`` with :func:`start_metrics_server`, which exposes only the metric
groups its role owns (``router`` → router; ``prefill`` → prefill + transfer; ``decode`` → decode;
``registry`` → registry), plus the Python process collectors and ``halfmoon_worker_info``. A
process therefore never exports all-zero series for quantities another service owns.

Worker identity is **not** a label on every metric: it comes from the scrape target (Prometheus'
``instance`` label, and on Kubernetes the ``pod``/``service`` labels a ServiceMonitor attaches). The
scrape job names the role: ``job="halfmoon-<role>"`` (the Helm chart's ServiceMonitor and
deploy/prometheus/prometheus-local.yml; the alert rules rely on it). The info gauge
``halfmoon_worker_info{role, worker_id, model, version} = 1`` carries the rest; join on
``instance`` when a panel needs the worker id, e.g.
``halfmoon_decode_kv_pool_usage_ratio * on(instance) group_left(worker_id) halfmoon_worker_info``.

Catalog (owner — name — type — labels — meaning)
------------------------------------------------
router (router_svc; tokens and latencies as the client sees them, one count per client request;
``tenant`` is the API key's tenant: a name of the key file, ``default`` or ``anonymous``, never a
client-chosen string)
  - ``halfmoon_router_requests_total`` counter {status, policy, tenant}: finished client requests;
    status ∈ :data:`REQUEST_STATUSES` (ok, error, cancelled, timeout, invalid, rejected,
    rate_limited, queue_full).
  - ``halfmoon_router_time_to_first_token_seconds`` histogram {tenant}: request arrival → first token sent.
  - ``halfmoon_router_inter_token_latency_seconds`` histogram {tenant}: gap between consecutive
    streamed tokens of one request (one observation per token after the first).
  - ``halfmoon_router_e2e_request_latency_seconds`` histogram {tenant}: arrival → last token / error.
  - ``halfmoon_router_retries_total`` counter {leg}: pair re-picks after a failed leg before the first
    token; leg ∈ {prefill, decode}.
  - ``halfmoon_router_local_prefills_total`` counter {reason}: attempts sent to a decode worker
    alone, which prefills the prompt's uncached tail itself (conditional disaggregation, no
    prefill leg); reason ∈ :data:`LOCAL_PREFILL_REASONS` (short_tail: D holds all but at most
    ``--local-prefill-max-tokens``; prefill_queue: every P has ``--local-prefill-queue`` requests).
  - ``halfmoon_router_requests_in_flight`` gauge: requests accepted and not yet finished.
  - ``halfmoon_router_queued_requests`` gauge: requests admitted whose first token is not sent yet
    (the admission queue ``--max-queued-requests`` bounds).
  - ``halfmoon_router_prompt_tokens_total`` counter {tenant}: prompt tokens of client requests (after
    the chat template), counted once per request whatever the retries.
  - ``halfmoon_router_completion_tokens_total`` counter {tenant}: tokens streamed to clients.
  - ``halfmoon_router_auth_failures_total`` counter {api, reason}: calls refused for their API key;
    api ∈ {http, grpc}, reason ∈ {missing, invalid}.
prefill (prefill_svc; work done by prefill workers, retried attempts included)
  - ``halfmoon_prefill_queue_requests`` gauge {queue}: requests per stage; queue ∈
    :data:`PREFILL_QUEUES` (waiting_destination, prefilling, transferring).
  - ``halfmoon_prefill_prompt_tokens_total`` counter: prompt tokens of Prefill RPCs accepted.
  - ``halfmoon_prefill_cached_tokens_total`` counter: of those, tokens served from the prefill radix
    cache (prefix hits; not recomputed). Hit rate = cached / prompt.
  - ``halfmoon_prefill_batch_size_requests`` histogram: requests per prefill forward batch.
  - ``halfmoon_prefill_batch_tokens`` histogram: extend tokens per prefill forward batch.
  - ``halfmoon_prefill_compute_seconds`` histogram: wall seconds of one prefill forward batch
    (``_sum`` is total compute time, so ``rate(_sum)`` is the busy fraction).
  - ``halfmoon_prefill_torch_threads`` gauge: torch intra-op threads P's forwards run with now
    (``--cpu-share``: all cores while the co-located decode worker is idle, its share otherwise).
transfer (transfer_svc engine, counted on the **sender**, i.e. in the prefill process; label-free)
  - ``halfmoon_transfer_pages_total`` counter: KV pages written to decode peers.
  - ``halfmoon_transfer_bytes_total`` counter: bytes written (GB/s = ``rate(...)/1e9`` in PromQL).
  - ``halfmoon_transfer_batch_seconds`` histogram: one submitted batch, submit → all writes complete.
  - ``halfmoon_transfer_failures_total`` counter {reason}: failed batches; reason ∈
    :data:`TRANSFER_FAILURE_REASONS` (timeout, peer_unreachable, remote_error, checksum_mismatch,
    aborted, other). All reasons are pre-initialised to 0 so rates exist before the first failure.
decode (decode_svc)
  - ``halfmoon_decode_queue_requests`` gauge {queue}: queue ∈ :data:`DECODE_QUEUES`: prealloc
    (waiting for KV pages), transfer (pages allocated, waiting for the prefill's KV + notice),
    waiting (KV committed, waiting to join the running batch), retracted (KV given back when the
    pool ran short, waiting to resume), local_prefill (no prefill leg: D computes the prompt's
    uncached tail itself).
  - ``halfmoon_decode_running_requests`` gauge: requests in the running (continuous) batch.
  - ``halfmoon_decode_kv_pool_usage_ratio`` gauge: 1 − (free + evictable) / total pages of the KV
    pool, in [0, 1]: the share held by requests (locked prefixes + owned pages), as SGLang's
    token usage; evictable radix pages count as available. Alerts and the decode HPA use it.
  - ``halfmoon_decode_kv_pool_pages`` gauge {state}: pages per state ∈ :data:`KV_PAGE_STATES`
    (free, evictable, locked, owned); the states sum to the pool size.
  - ``halfmoon_decode_prompt_tokens_total`` counter: prompt tokens of requests pre-allocated.
  - ``halfmoon_decode_prefix_hit_tokens_total`` counter: of those, tokens matched in the decode radix
    cache (sum of ``pre_len``; not transferred). Hit rate = prefix_hit / prompt.
  - ``halfmoon_decode_generated_tokens_total`` counter: tokens sampled by decode workers (first token
    from the prefill notice excluded).
  - ``halfmoon_decode_evicted_pages_total`` counter: radix-cache pages evicted (LRU) to make room.
  - ``halfmoon_decode_kv_checksum_mismatches_total`` counter: with ``--kv-checksums``, cached pages
    whose crc32 changed since they entered the radix cache, found when a prefix hit reused them
    (each is evicted with what follows it and recomputed, never served; one WARNING each).
  - ``halfmoon_decode_kv_wait_seconds`` histogram: pre-allocation done → KV committed (notice
    verified), per request.
  - ``halfmoon_decode_quarantine_releases_total`` counter {cause}: quarantined destination rooms
    released; cause ∈ :data:`QUARANTINE_RELEASE_CAUSES` (notice, rejected, process_gone,
    new_incarnation, fence_deadline). fence_deadline means P never answered within its write fence.
  - ``halfmoon_decode_retractions_total`` counter {reason}: running requests retracted because a
    decode step could not grow them; reason ∈ :data:`RETRACTION_REASONS` (newest: the newest
    unpinned request; pinned: every candidate was pinned, the newest taken).
  - ``halfmoon_decode_reserve_misses_total`` counter: decode steps at which a request outgrew its
    reserve and the pool (after eviction) could not give the next page.
  - ``halfmoon_decode_resume_recomputed_tokens_total`` counter: tokens D recomputed itself (EXTEND)
    when a retracted request resumed (its prefix the radix cache no longer held).
  - ``halfmoon_decode_local_prefills_total`` counter: requests whose prompt D prefilled itself
    (``DecodeRequest.local_prefill``: conditional disaggregation, no prefill leg).
  - ``halfmoon_decode_local_prefill_tokens_total`` counter: prompt tokens D computed (EXTEND) for
    them (prompt minus D's radix hit).
  - ``halfmoon_decode_kv_projected_pages`` gauge: pages the live requests are projected to still
    take (admission keeps them available); compare with ``kv_pool_pages{state="owned"}``.
  - ``halfmoon_decode_new_token_ratio`` gauge: the projection's ratio of remaining tokens a request
    is expected to still generate, in (0, 1].
  - ``halfmoon_decode_finished_token_share`` histogram: per request that ended by itself, generated
    / min(max_tokens, clip): the actual share that ``new_token_ratio`` projects (the ratio learns
    its moving average); projected vs actual usage is this against the ratio gauge.
  - ``halfmoon_decode_step_seconds_total`` counter {part}: wall seconds of decode steps (a step's
    start to the next one's, while requests run), part ∈ :data:`STEP_PARTS`: device (inside the
    forward and sampling calls, or waiting for their tokens) or host (the rest: bookkeeping,
    streaming, the GIL).
  - ``halfmoon_decode_step_requests_total`` counter: running requests summed over those steps;
    ``rate(step_seconds{part="host"}) / rate(step_requests)`` is the host cost per request-step.
  - ``halfmoon_decode_torch_threads`` gauge: torch intra-op threads D's forwards run with now
    (``--cpu-share``: all cores while the co-located prefill worker is idle, its share otherwise).
registry (transfer_svc registry service, ``halfmoon serve-transfer``)
  - ``halfmoon_registry_workers`` gauge {role}: live registered workers; role ∈ {prefill, decode}.
  - ``halfmoon_registry_expired_leases_total`` counter: segments dropped because heartbeats stopped.
  - ``halfmoon_registry_lookups_total`` counter {result}: GetSegment calls; result ∈ {found,
    not_found}.
every process
  - ``halfmoon_worker_info`` gauge {role, worker_id, model, version} = 1 (set by
    :func:`start_metrics_server`), and prometheus_client's ``process_*`` / ``python_*`` collectors.

Histogram buckets (seconds) span CPU and GPU: TTFT 5 ms–120 s, ITL 0.5 ms–5 s, forward 0.5 ms–60 s,
transfer batch 10 µs–10 s (one UCX put is ≈1 µs on shared memory, ≈8 µs through cuda_ipc, as
measured with bench/transfer.py and bench/gpu_transfer.py).
"""

from __future__ import annotations

from telemetry.label_values import (  # noqa: F401
    REQUEST_STATUSES, RETRY_LEGS, MIGRATION_REASONS, PREFILL_QUEUES, DECODE_QUEUES, LOCAL_PREFILL_REASONS,
    STEP_PARTS, RETRACTION_REASONS, KV_PAGE_STATES, QUARANTINE_RELEASE_CAUSES, TRANSFER_FAILURE_REASONS,
    WORKER_ROLES, REGISTRY_LOOKUP_RESULTS)
from telemetry.buckets import (  # noqa: F401
    TTFT_BUCKETS, ITL_BUCKETS, E2E_BUCKETS, COMPUTE_BUCKETS, TRANSFER_BUCKETS, KV_WAIT_BUCKETS, SHARE_BUCKETS,
    BATCH_REQUEST_BUCKETS, BATCH_TOKEN_BUCKETS)
from telemetry.router_metrics import (  # noqa: F401
    AUTH_APIS, AUTH_FAILURE_REASONS, init_router_series,
    ROUTER_REQUESTS, ROUTER_TTFT, ROUTER_ITL, ROUTER_E2E, ROUTER_RETRIES, ROUTER_LOCAL_PREFILLS,
    ROUTER_MIGRATIONS, ROUTER_IN_FLIGHT, ROUTER_QUEUED, ROUTER_PROMPT_TOKENS,
    ROUTER_COMPLETION_TOKENS, ROUTER_AUTH_FAILURES)
from telemetry.prefill_metrics import (  # noqa: F401
    PREFILL_QUEUE, PREFILL_PROMPT_TOKENS, PREFILL_CACHED_TOKENS, PREFILL_BATCH_SIZE,
    PREFILL_BATCH_TOKENS, PREFILL_COMPUTE_SECONDS, PREFILL_TORCH_THREADS)
from telemetry.transfer_metrics import (  # noqa: F401
    TRANSFER_PAGES, TRANSFER_RANK_PAGES, TRANSFER_BYTES, TRANSFER_BATCH_SECONDS, TRANSFER_FAILURES)
from telemetry.decode_metrics import (  # noqa: F401
    DECODE_QUEUE, DECODE_RUNNING, DECODE_KV_USAGE, DECODE_KV_PAGES, DECODE_PROMPT_TOKENS,
    DECODE_PREFIX_HIT_TOKENS, DECODE_GENERATED_TOKENS, DECODE_EVICTED_PAGES,
    DECODE_KV_CHECKSUM_MISMATCHES, DECODE_KV_WAIT_SECONDS, DECODE_QUARANTINE_RELEASES,
    DECODE_RETRACTIONS, DECODE_RESERVE_MISSES, DECODE_RESUME_RECOMPUTED_TOKENS,
    DECODE_LOCAL_PREFILLS, DECODE_LOCAL_PREFILL_TOKENS, DECODE_PROJECTED_PAGES,
    DECODE_NEW_TOKEN_RATIO, DECODE_STEP_SECONDS, DECODE_STEP_REQUESTS, DECODE_FINISHED_TOKEN_SHARE,
    DECODE_TORCH_THREADS)
from telemetry.registry_metrics import (  # noqa: F401
    REGISTRY_WORKERS, REGISTRY_EXPIRED_LEASES, REGISTRY_LOOKUPS)
from telemetry.exposition import (  # noqa: F401
    METRICS_BY_GROUP, GROUPS_BY_ROLE, ROLES, build_registry, start_metrics_server, stop_metrics_servers)

__all__ = [
    "ROLES", "GROUPS_BY_ROLE", "REQUEST_STATUSES", "PREFILL_QUEUES", "DECODE_QUEUES", "LOCAL_PREFILL_REASONS",
    "STEP_PARTS",
    "RETRACTION_REASONS",
    "KV_PAGE_STATES", "TRANSFER_FAILURE_REASONS", "QUARANTINE_RELEASE_CAUSES", "REGISTRY_LOOKUP_RESULTS", "METRICS_BY_GROUP",
    "build_registry", "start_metrics_server", "stop_metrics_servers",
]

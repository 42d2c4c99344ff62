"""Workloads of the transfer benchmark: [(src offset, dst offset, bytes)] within a 128 MiB source and
a 128 MiB destination buffer, and the memcpy that replays them (the ceiling, and the expected bytes)."""

from __future__ import annotations

import time

import numpy as np

MiB = 1 << 20
REGION = 128 * MiB
CHUNK = 128 * 1024

# SmolLM2-135M KV shape (its config.json): fp32, page 16 tokens
KV_LAYERS, KV_HEADS, HEAD_DIM, PAGE_TOKENS, DTYPE_BYTES = 30, 3, 64, 16, 4
PAGE_BYTES = PAGE_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # 12 KiB per page per buffer
N_BUFFERS = 2 * KV_LAYERS
POOL_PAGES = REGION // (N_BUFFERS * PAGE_BYTES)  # pages per buffer that fit in the region
DELTA_RUNS, RUN_PAGES = 8, 8

WORKLOADS = ["scattered", "large", "kv_layer", "kv_page_major", "kv_contiguous", "kv_one_page"]


def _runs(rng: np.random.Generator) -> list[int]:
    """Start pages of DELTA_RUNS non-overlapping runs of RUN_PAGES pages in the pool."""
    slots = rng.permutation(POOL_PAGES // RUN_PAGES)[:DELTA_RUNS]
    return [int(s) * RUN_PAGES for s in slots]


def make_workloads(seed: int = 0) -> dict[str, list[tuple[int, int, int]]]:
    """name -> [(src offset, dst offset, bytes)] within the 128 MiB source / destination buffers."""
    rng = np.random.default_rng(seed)
    src_slots = rng.permutation(REGION // CHUNK)[:512]
    dst_slots = rng.permutation(REGION // CHUNK)[:512]
    w = {"scattered": [(int(s) * CHUNK, int(d) * CHUNK, CHUNK) for s, d in zip(src_slots, dst_slots)],
         "large": [(0, 32 * MiB, 64 * MiB)]}
    src_runs, dst_runs = _runs(rng), _runs(rng)
    buf_bytes = POOL_PAGES * PAGE_BYTES
    # per-layer pool: buffer b (= 2*layer + k/v) is [POOL_PAGES pages] at b * buf_bytes
    w["kv_layer"] = [(b * buf_bytes + sp * PAGE_BYTES, b * buf_bytes + dp * PAGE_BYTES,
                      RUN_PAGES * PAGE_BYTES)
                     for b in range(N_BUFFERS) for sp, dp in zip(src_runs, dst_runs)]
    stride = N_BUFFERS * PAGE_BYTES  # page-major: page p holds every buffer's page p
    w["kv_page_major"] = [(sp * stride, dp * stride, RUN_PAGES * stride)
                          for sp, dp in zip(src_runs, dst_runs)]
    total = sum(n for _, _, n in w["kv_layer"])
    w["kv_contiguous"] = [(0, 0, total)]
    # a short request's delta: one page, per-layer pool -> 60 writes of 12 KiB (latency-bound)
    w["kv_one_page"] = [(b * buf_bytes + src_runs[0] * PAGE_BYTES, b * buf_bytes + dst_runs[0] * PAGE_BYTES,
                         PAGE_BYTES) for b in range(N_BUFFERS)]
    return w


def fill(buf: np.ndarray, seed: int) -> None:
    """Random bytes of ``seed`` (the initiators' and memcpy's source buffers use seed 1)."""
    buf[:] = np.random.default_rng(seed).integers(0, 256, size=buf.size, dtype=np.uint8)


def memcpy_run(src: np.ndarray, dst: np.ndarray, descs) -> float:
    """Seconds to copy ``descs`` from ``src`` into ``dst`` with numpy, in one process."""
    t0 = time.perf_counter()
    for s, d, n in descs:
        dst[d:d + n] = src[s:s + n]
    return time.perf_counter() - t0

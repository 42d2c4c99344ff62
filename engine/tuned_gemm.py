"""Autotuned GEMMs for the projections captured in the decode graphs (off by default).

torch's ``F.linear`` asks cuBLAS (or cuBLASLt) for its heuristic's first algorithm for each shape.
At decode shapes (M = 1-128 rows against a 4096-28672 x 4096-14336 weight) that first pick is not
always the fastest. flashinfer's ``mm_bf16`` with its autotuner times every candidate algorithm of a
backend once per shape and keeps the fastest:

* "cublaslt": every algorithm cuBLASLt's heuristic offers for the shape;
* "cudnn": cuDNN's execution plans for the matmul graph;
* "auto": both of those, tinygemm and TGV, whichever is fastest per shape. flashinfer 0.6.18 builds
  its TGV candidate with the CuTe DSL, so "auto" needs the ``nvidia-cutlass-dsl`` package (import
  name ``cutlass``); without it every auto call fails inside flashinfer with a LibraryError, so
  :meth:`TunedGemm.from_env` refuses it at start instead.

Why it stays off (H100 80GB, Llama-3.1-8B shape bf16, decode-graph replay, two interleaved runs a
machine; bench/results/GPU_NOTES.md, session 15, calls 2-3): alone, the tuned kernels are 3-5 %
faster than torch's pick at 2-16 rows (gate/up 77.6-79.1 µs against 81.5-82.9). In the step, on one
machine cublaslt saved 0.05-0.10 ms at B = 8-32 and lost 0.02-0.09 ms at B = 1 and >= 64; on a
second machine, with the same code, it saved 0.01-0.09 ms at B = 2, 8, 16 (ctx 1k), tied or lost at B=4, and *lost* 0.03-0.12 ms
at B=32 and at B=16 ctx 4k. The autotuner times each GEMM alone; in the graph the neighbours'
L2 and clock state differ, so its pick does not reliably beat cuBLAS's heuristic. cudnn won only at
B=1 (-0.01 to -0.035 ms) and lost from 16 up. ``HALFMOON_TUNED_GEMM=cublaslt`` with
``HALFMOON_TUNED_GEMM_ROWS=2-16`` is the setting to measure on a new machine.

A decode graph of bucket ``b`` runs every projection at exactly ``b`` rows, so each bucket's capture
tunes at that M alone (``tuning_buckets=(b,)``) in its warm-up forwards and captures with the tuned
choice (:meth:`TunedGemm.scope`); eager forwards (prefill, extend, graphs off) keep ``F.linear``.
The choice of tactic depends on the machine's clocks and the other shapes' L2 state, so it is made
on the machine that serves; ``HALFMOON_TUNED_GEMM_CACHE`` keeps it in a JSON file across starts.

Env: ``HALFMOON_TUNED_GEMM`` (:data:`TUNED_GEMM_BACKENDS`, default "off"),
``HALFMOON_TUNED_GEMM_ROWS`` (the buckets that take it, "lo-hi" rows, default every bucket),
``HALFMOON_TUNED_GEMM_ON`` (comma list of projections, default all four),
``HALFMOON_TUNED_GEMM_CACHE`` (a path in an existing folder, default none). Projections of <= 8 rows that tinygemm takes
(:mod:`engine.small_m_gemm`) stay on tinygemm.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

from engine.small_m_gemm import PROJECTIONS

TUNED_GEMM_BACKENDS = ("off", "cublaslt", "cudnn", "auto")
ALL_ROWS = (1, 1 << 30)  # the buckets (rows, inclusive) that take it unless HALFMOON_TUNED_GEMM_ROWS says


def tuned_gemm_backend() -> str:
    """The backend from env ``HALFMOON_TUNED_GEMM`` (default "off"). Raises ValueError naming the
    variable on any value not in :data:`TUNED_GEMM_BACKENDS`."""
    backend = os.environ.get("HALFMOON_TUNED_GEMM", "off")
    if backend not in TUNED_GEMM_BACKENDS:
        raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: expected one of {TUNED_GEMM_BACKENDS}")
    return backend


def tuned_rows() -> tuple[int, int]:
    """The inclusive row range of the buckets that take the tuned GEMM, from env
    ``HALFMOON_TUNED_GEMM_ROWS`` ("lo-hi", e.g. "2-16"; default :data:`ALL_ROWS`). Raises
    ValueError naming the variable on anything but two integers 1 <= lo <= hi."""
    env = os.environ.get("HALFMOON_TUNED_GEMM_ROWS", "").strip()
    if not env:
        return ALL_ROWS
    lo, sep, hi = env.partition("-")
    try:
        rows = (int(lo), int(hi))
    except ValueError:
        rows = None
    if not sep or rows is None or not 1 <= rows[0] <= rows[1]:
        raise ValueError(f"HALFMOON_TUNED_GEMM_ROWS={env!r}: expected 'lo-hi' rows with 1 <= lo <= hi")
    return rows


def tuned_cache() -> str | None:
    """The autotuner's JSON file from env ``HALFMOON_TUNED_GEMM_CACHE`` (default none). flashinfer
    loads it on entry to each tuning scope and replaces it atomically on exit (a temporary file in
    the same folder, so tensor-parallel ranks may share one path). Raises ValueError naming the
    variable when its folder does not exist: flashinfer would fail only at the first save, in the
    graph warm-up after the model has loaded."""
    path = os.environ.get("HALFMOON_TUNED_GEMM_CACHE") or None
    if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise ValueError(f"HALFMOON_TUNED_GEMM_CACHE={path!r}: its folder does not exist")
    return path


def tuned_projections() -> frozenset[str]:
    """Which projections the tuned GEMM takes, from env ``HALFMOON_TUNED_GEMM_ON`` (a comma list of
    :data:`~engine.small_m_gemm.PROJECTIONS`; default all). Raises ValueError naming an unknown one."""
    env = os.environ.get("HALFMOON_TUNED_GEMM_ON", ",".join(PROJECTIONS))
    names = [n.strip() for n in env.split(",") if n.strip()]
    if not names:
        raise ValueError(f"HALFMOON_TUNED_GEMM_ON={env!r}: names no projection; expected some of {PROJECTIONS}")
    bad = [n for n in names if n not in PROJECTIONS]
    if bad:
        raise ValueError(f"HALFMOON_TUNED_GEMM_ON: unknown projection(s) {bad}; expected some of {PROJECTIONS}")
    return frozenset(names)


def tuned_gemm_available(device: torch.device, flashinfer) -> bool:
    """flashinfer has ``mm_bf16`` and its ``autotune`` context, and ``device`` is a GPU of sm80+
    (the capability cuBLASLt's and cuDNN's bf16 runners need)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)
            and hasattr(flashinfer, "mm_bf16") and hasattr(flashinfer, "autotune"))


class TunedGemm:
    """``x @ weight.T`` through ``flashinfer.mm_bf16`` with one backend, tuned per bucket.

    ``fi``: the flashinfer module (or anything with ``mm_bf16`` and ``autotune``); ``backend``: one
    of "cublaslt", "cudnn", "auto"; ``on``: the projections it takes; ``rows``: the inclusive row
    range of the buckets it takes; ``cache``: a JSON path for the autotuner's choices, or None.
    ``active`` is true inside :meth:`scope` of a bucket in ``rows`` only, so only those buckets'
    graph warm-ups and captures use it.
    """

    def __init__(self, fi, backend: str, on: frozenset[str], cache: str | None = None,
                 rows: tuple[int, int] = ALL_ROWS):
        if backend not in TUNED_GEMM_BACKENDS[1:]:
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: expected one of {TUNED_GEMM_BACKENDS[1:]}")
        self.fi, self.backend, self.on, self.cache, self.rows = fi, backend, on, cache, rows
        self.active = False
        self.calls = 0  # projections issued on it (warm-ups + captures)

    @classmethod
    def from_env(cls, fi, device: torch.device, dtype: torch.dtype) -> "TunedGemm | None":
        """The tuned GEMM the env asks for, or None when ``HALFMOON_TUNED_GEMM`` is "off". Raises
        ValueError when it is asked for on a device or flashinfer without it, a model not bf16, or
        "auto" without the CuTe DSL package."""
        backend = tuned_gemm_backend()
        on, rows = tuned_projections(), tuned_rows()
        if backend == "off":
            return None
        if backend == "auto" and importlib.util.find_spec("cutlass") is None:
            raise ValueError("HALFMOON_TUNED_GEMM='auto': flashinfer's auto backend needs the CuTe DSL "
                             "(pip install 'nvidia-cutlass-dsl[cu13]'); use 'cublaslt' or 'cudnn'")
        if not tuned_gemm_available(device, fi):
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: needs an sm80+ GPU and a flashinfer with mm_bf16")
        if dtype != torch.bfloat16:
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: mm_bf16 needs a bfloat16 model, not {dtype}")
        return cls(fi, backend, on, tuned_cache(), rows)

    def takes(self, proj: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Inside a scope, for an enabled ``proj``: x [T, K] and weight [N, K] both bf16 and
        contiguous, no bias (cuBLASLt's and cuDNN's mm_bf16 runners take none)."""
        return (self.active and proj in self.on and bias is None and x.dim() == 2 and x.shape[0] > 0
                and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
                and x.is_contiguous() and weight.is_contiguous() and x.shape[1] == weight.shape[1])

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """bf16 [T, N] = x [T, K] @ weight[N, K].T (weight passed K-major, as mm_bf16 wants it)."""
        self.calls += 1
        return self.fi.mm_bf16(x, weight.t(), backend=self.backend)

    @contextlib.contextmanager
    def scope(self, rows: int, tune: bool) -> Iterator[None]:
        """Use the tuned GEMM for forwards of ``rows`` rows: ``tune`` times the candidates of every
        shape not yet tuned (warm-up forwards, outside a graph); ``tune=False`` only looks the
        choices up (the capture: no timing inside a graph). Both measure at exactly ``rows``: the
        autotuner keys a choice by its bucket, and its default buckets would round ``rows`` down.
        A bucket outside :attr:`rows` opens no scope: its forwards keep ``F.linear``."""
        if not self.rows[0] <= rows <= self.rows[1]:
            yield
            return
        with self.fi.autotune(tune, cache=self.cache, tuning_buckets=(rows,)):
            self.active = True
            try:
                yield
            finally:
                self.active = False

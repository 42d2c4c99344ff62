"""Autotuned GEMMs for the projections captured in the decode graphs of 2-32 rows (on by default).

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

Measured (H100 80GB, Llama-3.1-8B shape bf16, decode-graph replay ms, off | cublaslt, two
interleaved runs each; bench/results/GPU_NOTES.md, session 15): ctx 1k B=1 6.296 | 6.300-6.318,
B=8 6.770-6.781 | 6.691-6.708, B=16 7.356 | 7.287-7.292, B=32 8.110 | 8.061-8.065, B=64 9.684-9.690
| 9.729-9.739, B=128 12.970-12.976 | 13.000-13.005; ctx 4k B=1 6.426-6.429 | 6.463-6.474, B=8
7.819-7.823 | 7.748-7.749, B=16 9.525-9.528 | 9.426, B=32 12.463-12.470 | 12.394-12.395, B=64
18.129-18.142 | 18.219-18.225. The tuned kernels win from 8 to 32 rows (gate/up 78.6-79.1 µs against
cuBLAS's 82.6-82.9 at M = 8-16, q/k/v 19.7-20.0 against 20.9-21.3 at M = 16-32) and lose at 1 row
and from 64 (where the graphs' cuBLASLt captures already pick well), so by default only buckets of
:data:`DEFAULT_ROWS` take it; 2-4 rows are in on the GEMM figures alone (gate/up 77.6-78.8 µs against
81.5-81.9). cudnn won only at B=1 (-0.01 to -0.035 ms) and lost from 16 up.

A decode graph of bucket ``b`` runs every projection at exactly ``b`` rows, so each bucket's capture
tunes at that M alone (``tuning_buckets=(b,)``) in its warm-up forwards and captures with the tuned
choice (:meth:`TunedGemm.scope`); eager forwards (prefill, extend, graphs off) keep ``F.linear``.
The choice of tactic depends on the machine's clocks and the other shapes' L2 state, so it is made
on the machine that serves; ``HALFMOON_TUNED_GEMM_CACHE`` keeps it in a JSON file across starts.

Env: ``HALFMOON_TUNED_GEMM`` (:data:`TUNED_GEMM_BACKENDS`; default "default": "cublaslt" where it
can run — an sm80+ GPU, a bf16 model, a flashinfer with mm_bf16 — else off),
``HALFMOON_TUNED_GEMM_ROWS`` (the buckets that take it, "lo-hi" rows, default :data:`DEFAULT_ROWS`),
``HALFMOON_TUNED_GEMM_ON`` (comma list of projections, default all four),
``HALFMOON_TUNED_GEMM_CACHE`` (a path, default none). Projections of <= 8 rows that tinygemm takes
(:mod:`engine.small_m_gemm`) stay on tinygemm.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

from engine.small_m_gemm import PROJECTIONS

TUNED_GEMM_BACKENDS = ("default", "off", "cublaslt", "cudnn", "auto")
DEFAULT_ROWS = (2, 32)  # the buckets (rows, inclusive) that take it unless HALFMOON_TUNED_GEMM_ROWS says


def tuned_gemm_backend() -> str:
    """The backend from env ``HALFMOON_TUNED_GEMM`` (default "default"). Raises ValueError naming the
    variable on any value not in :data:`TUNED_GEMM_BACKENDS`."""
    backend = os.environ.get("HALFMOON_TUNED_GEMM", "default")
    if backend not in TUNED_GEMM_BACKENDS:
        raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: expected one of {TUNED_GEMM_BACKENDS}")
    return backend


def tuned_rows() -> tuple[int, int]:
    """The inclusive row range of the buckets that take the tuned GEMM, from env
    ``HALFMOON_TUNED_GEMM_ROWS`` ("lo-hi", e.g. "2-32"; default :data:`DEFAULT_ROWS`). Raises
    ValueError naming the variable on anything but two integers 1 <= lo <= hi."""
    env = os.environ.get("HALFMOON_TUNED_GEMM_ROWS", "").strip()
    if not env:
        return DEFAULT_ROWS
    lo, sep, hi = env.partition("-")
    try:
        rows = (int(lo), int(hi))
    except ValueError:
        rows = None
    if not sep or rows is None or not 1 <= rows[0] <= rows[1]:
        raise ValueError(f"HALFMOON_TUNED_GEMM_ROWS={env!r}: expected 'lo-hi' rows with 1 <= lo <= hi")
    return rows


def tuned_projections() -> frozenset[str]:
    """Which projections the tuned GEMM takes, from env ``HALFMOON_TUNED_GEMM_ON`` (a comma list of
    :data:`~engine.small_m_gemm.PROJECTIONS`; default all). Raises ValueError naming an unknown one."""
    env = os.environ.get("HALFMOON_TUNED_GEMM_ON", ",".join(PROJECTIONS))
    names = [n.strip() for n in env.split(",") if n.strip()]
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
                 rows: tuple[int, int] = (1, 1 << 30)):
        if backend not in TUNED_GEMM_BACKENDS[2:]:
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: expected one of {TUNED_GEMM_BACKENDS[2:]}")
        self.fi, self.backend, self.on, self.cache, self.rows = fi, backend, on, cache, rows
        self.active = False
        self.calls = 0  # projections issued on it (warm-ups + captures)

    @classmethod
    def from_env(cls, fi, device: torch.device, dtype: torch.dtype) -> "TunedGemm | None":
        """The tuned GEMM the env asks for, or None when ``HALFMOON_TUNED_GEMM`` is "off" (or
        "default" where it cannot run). Raises ValueError when a backend is named on a device or
        flashinfer without it, a model not bf16, or "auto" without the CuTe DSL package."""
        backend = tuned_gemm_backend()
        on, rows = tuned_projections(), tuned_rows()
        if backend == "off":
            return None
        if backend == "default":
            if not tuned_gemm_available(device, fi) or dtype != torch.bfloat16:
                return None
            backend = "cublaslt"
        if backend == "auto" and importlib.util.find_spec("cutlass") is None:
            raise ValueError("HALFMOON_TUNED_GEMM='auto': flashinfer's auto backend needs the CuTe DSL "
                             "(pip install 'nvidia-cutlass-dsl[cu13]'); use 'cublaslt' or 'cudnn'")
        if not tuned_gemm_available(device, fi):
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: needs an sm80+ GPU and a flashinfer with mm_bf16")
        if dtype != torch.bfloat16:
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: mm_bf16 needs a bfloat16 model, not {dtype}")
        return cls(fi, backend, on, os.environ.get("HALFMOON_TUNED_GEMM_CACHE") or None, rows)

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

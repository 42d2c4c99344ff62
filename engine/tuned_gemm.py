"""Autotuned GEMMs for the projections captured in the decode graphs (off by default).

torch's ``F.linear`` asks cuBLAS (or cuBLASLt) for its heuristic's first algorithm for each shape.
At decode shapes (M = 1-128 rows against a 4096-28672 x 4096-14336 weight) that first pick is not
always the fastest: the measured spread between cuBLAS and cuBLASLt alone was 0.07-0.19 ms a step
on the H200 (bench/results/GPU_NOTES.md, session 13, call 6). flashinfer's ``mm_bf16`` with its
autotuner times every candidate algorithm of a backend once per shape and keeps the fastest:

* "cublaslt": every algorithm cuBLASLt's heuristic offers for the shape;
* "cudnn": cuDNN's execution plans for the matmul graph;
* "auto": both of those, tinygemm and TGV, whichever is fastest per shape. flashinfer 0.6.18 builds
  its TGV candidate with the CuTe DSL, so "auto" needs the ``nvidia-cutlass-dsl`` package (import
  name ``cutlass``); without it every auto call fails inside flashinfer with a LibraryError, so
  :meth:`TunedGemm.from_env` refuses it at start instead.

A decode graph of bucket ``b`` runs every projection at exactly ``b`` rows, so each bucket's capture
tunes at that M alone (``tuning_buckets=(b,)``) in its warm-up forwards and captures with the tuned
choice (:meth:`TunedGemm.scope`); eager forwards (prefill, extend, graphs off) keep ``F.linear``.
The choice of tactic depends on the machine's clocks and the other shapes' L2 state, so it is made
on the machine that serves; ``HALFMOON_TUNED_GEMM_CACHE`` keeps it in a JSON file across starts.

Env: ``HALFMOON_TUNED_GEMM`` (:data:`TUNED_GEMM_BACKENDS`, default "off"),
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

TUNED_GEMM_BACKENDS = ("off", "cublaslt", "cudnn", "auto")


def tuned_gemm_backend() -> str:
    """The backend from env ``HALFMOON_TUNED_GEMM`` (default "off"). Raises ValueError naming the
    variable on any value not in :data:`TUNED_GEMM_BACKENDS`."""
    backend = os.environ.get("HALFMOON_TUNED_GEMM", "off")
    if backend not in TUNED_GEMM_BACKENDS:
        raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: expected one of {TUNED_GEMM_BACKENDS}")
    return backend


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
    of :data:`TUNED_GEMM_BACKENDS` but "off"; ``on``: the projections it takes; ``cache``: a JSON
    path for the autotuner's choices, or None. ``active`` is true inside :meth:`scope` only, so
    only the graph runner's warm-ups and captures use it.
    """

    def __init__(self, fi, backend: str, on: frozenset[str], cache: str | None = None):
        if backend not in TUNED_GEMM_BACKENDS or backend == "off":
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: expected one of {TUNED_GEMM_BACKENDS[1:]}")
        self.fi, self.backend, self.on, self.cache = fi, backend, on, cache
        self.active = False
        self.calls = 0  # projections issued on it (warm-ups + captures)

    @classmethod
    def from_env(cls, fi, device: torch.device, dtype: torch.dtype) -> "TunedGemm | None":
        """The tuned GEMM the env asks for, or None when ``HALFMOON_TUNED_GEMM`` is "off". Raises
        ValueError when it is asked for on a device or flashinfer without it, a model not bf16, or
        "auto" without the CuTe DSL package."""
        backend = tuned_gemm_backend()
        on = tuned_projections()
        if backend == "off":
            return None
        if backend == "auto" and importlib.util.find_spec("cutlass") is None:
            raise ValueError("HALFMOON_TUNED_GEMM='auto': flashinfer's auto backend needs the CuTe DSL "
                             "(pip install 'nvidia-cutlass-dsl[cu13]'); use 'cublaslt' or 'cudnn'")
        if not tuned_gemm_available(device, fi):
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: needs an sm80+ GPU and a flashinfer with mm_bf16")
        if dtype != torch.bfloat16:
            raise ValueError(f"HALFMOON_TUNED_GEMM={backend!r}: mm_bf16 needs a bfloat16 model, not {dtype}")
        return cls(fi, backend, on, os.environ.get("HALFMOON_TUNED_GEMM_CACHE") or None)

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
        autotuner keys a choice by its bucket, and its default buckets would round ``rows`` down."""
        with self.fi.autotune(tune, cache=self.cache, tuning_buckets=(rows,)):
            self.active = True
            try:
                yield
            finally:
                self.active = False

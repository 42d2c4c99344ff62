"""How a float32 (or bfloat16) ``nn.Linear`` runs on the CPU: plain ``F.linear``, or weights packed
once for our small-M kernel (decode) and for oneDNN (prefill).

``F.linear`` hands the row-major weight to MKL's ``sgemm``, which copies the weight panel into its
blocked layout inside every call (the largest single cost of a CPU decode step in the profile of
issue 22). :class:`PackedLinear` reorders the weight once, at load, into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU freezing uses) and calls
``torch.ops.mkldnn._linear_pointwise`` on it; one packed copy serves every batch size, decode at
batch 1 included: MKL's gemv on the row-major weight (``F.linear`` with one row) made a SmolLM2 B=1
decode step 37.7 ms on one thread and 37.5 ms on two (it did not use the second thread), the packed
GEMM 31.5 and 30.1 ms, greedy tokens equal (bench/README.md, "Decode at batch 1"). ``gemv_rows``
keeps the gemv path for rows ``M <= gemv_rows`` (default 0: none) for comparison.

Decode-sized inputs (``M <= small_rows``, default 64) go to our own kernel instead
(``models/csrc/small_gemm.cpp``, built by ``make kernels``: weights packed as blocks of 16 (AVX2) or
32 (AVX-512) output rows, each streamed once whatever M is): on the 2-core AMD (AVX2) test box the
torch wheel's oneDNN/MKL ran the SmolLM2 layers' GEMMs at M=1 at 7-8 GB/s and at M=8 at 3.5 GB/s of
weights against 12-13 GB/s copy bandwidth, since MKL takes its generic path on non-Intel CPUs; the
kernel was 1.2-1.8x faster than oneDNN for M in 1..64 on 1 and 2 threads (bench/README.md, "Small-M
GEMM kernel"). Above ``small_rows`` oneDNN's blocked GEMM stays faster (prefill: 597 vs 725 ms for
193 rows through F.linear, 1 thread). That costs a second packed copy of every linear weight;
``cpu_linear=onednn`` keeps only oneDNN's.

Numerics: the packed GEMM sums in another order than MKL (float32 results differ in the last bits,
~4e-6 relative); greedy tokens stay equal to transformers' on the golden prompts
(tests/unit/test_engine_golden.py runs with packing on).

bfloat16 (``--dtype bfloat16``, opt-in; float32 stays the token-identical default): packed only where
oneDNN has native bf16 GEMMs (:func:`bf16_gemm_supported`: AVX512-BF16 or AMX), else ``F.linear``.
The small-M kernel reads the bf16 weights and sums in float32; oneDNN (prefill) rounds x to bf16
and sums in float32. Results are within bf16 rounding of the float32 model, not equal to it.

Memory: a ``PackedLinear`` holds the packed copies next to the original weight. Once a whole model
is packed (``engine.torch_fused_ops``), :func:`release_packed_sources` frees the row-major originals
that nothing reads any more, so a packed model holds two copies of its linear weights (oneDNN's and
the kernel's), not three. It runs layer by layer, so loading peaks at one layer's copies over the
final footprint (the test box's 24 GB ran out under the parallel suite while every worker held
three copies). Tied weights (SmolLM2's ``lm_head`` and embedding) stay: the embedding reads them.
"""

from __future__ import annotations

import ctypes
import enum
import logging

import torch
from torch import nn
import torch.nn.functional as F

from engine.cpu_kernels import SMALL_GEMM

log = logging.getLogger("halfmoon.engine.models")

SMALL_ROWS = 64  # the kernel's row limit (MAX_M in small_gemm.cpp), and where oneDNN starts to win
# bf16 weights: the kernel widens each to float32 (compute grows with M) while oneDNN's native bf16
# GEMM (AMX) does not: on the Xeon box a SmolLM2 decode step (ctx 200) was faster on the kernel up to
# B=8 (2 threads: B=1 23.9 vs 26.5 ms, B=8 29.4 vs 30.2) and slower from B=12 (37.8 vs 34.6)
BF16_SMALL_ROWS = 8


def small_gemm_kernel():
    """The built small-M kernel module, or None (the reason logged once per process)."""
    return SMALL_GEMM.load_or_say_why(log, "cpu_linear: decode GEMMs on oneDNN, not the small-M kernel")


class CpuLinear(enum.Enum):
    """``EngineConfig.cpu_linear``: ``torch`` (``F.linear`` everywhere), ``packed`` (the small-M
    kernel up to ``SMALL_ROWS`` rows when ``make kernels`` built it, oneDNN packed weights above) or
    ``onednn`` (oneDNN packed weights for every batch size)."""

    TORCH = "torch"
    PACKED = "packed"
    ONEDNN = "onednn"

    @property
    def packs(self) -> bool:
        return self is not CpuLinear.TORCH

    @property
    def small_rows(self) -> int:
        """``PackedLinear``'s ``small_rows`` under this choice (0: oneDNN only)."""
        return SMALL_ROWS if self is CpuLinear.PACKED else 0

    @classmethod
    def parse(cls, value: "str | CpuLinear") -> "CpuLinear":
        """Raises ValueError naming ``cpu_linear`` for anything but the enum's values."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"cpu_linear: must be one of {[m.value for m in cls]}, got {value!r}") from None


def bf16_gemm_supported() -> bool:
    """True where oneDNN runs bfloat16 GEMMs natively (AVX512-BF16 or AMX): a bf16 CPU model's
    linears are packed only there; elsewhere oneDNN would emulate bf16 slower than float32."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_linear_supported(weight: torch.Tensor) -> bool:
    """True for a CPU weight oneDNN packs: float32 with oneDNN available, bfloat16 where
    :func:`bf16_gemm_supported`."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_gemm_supported())


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` [N, K] packed once: oneDNN's blocked layout, and
    the small-M kernel's blocks when ``small_rows`` > 0 and the kernel is built.

    ``weight`` / ``bias`` are the original parameters (same objects, so state-dict names and weight
    ties are unchanged). Input [..., K] CPU of the weight's dtype (float32, or bfloat16 where
    :func:`bf16_gemm_supported`); output [..., N] of that dtype. ``small_rows``: inputs of at most
    that many rows (<= ``SMALL_ROWS``) take the small-M kernel; 0 = oneDNN only. With bfloat16
    weights the kernel streams half the bytes (it widens them to float32 in registers and sums in
    float32) up to ``BF16_SMALL_ROWS`` rows, and oneDNN's native bf16 GEMM (AMX / AVX512-BF16) runs
    the rest.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv_rows: int = 0,
                 small_rows: int = SMALL_ROWS):
        super().__init__()
        if not packed_linear_supported(weight):
            raise ValueError("cpu_linear: packed weights need a float32 CPU weight and oneDNN, or a bfloat16 "
                             "one on a CPU with native bf16 GEMMs (AVX512-BF16 or AMX)")
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.gemv_rows = gemv_rows
        self.out_features, self.in_features = weight.shape
        if not 0 <= small_rows <= SMALL_ROWS:
            raise ValueError(f"small_rows: must be in [0, {SMALL_ROWS}], got {small_rows}")
        if weight.dtype == torch.bfloat16:
            small_rows = min(small_rows, BF16_SMALL_ROWS)
        self.small_rows = small_rows if small_rows and small_gemm_kernel() is not None else 0
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8),
                                 persistent=False)
            small = torch.ops.halfmoon.small_gemm_pack(weight.detach()) if self.small_rows else None
            self.register_buffer("small_packed", small, persistent=False)

    @classmethod
    def from_linear(cls, lin: nn.Linear, gemv_rows: int = 0, small_rows: int = SMALL_ROWS) -> "PackedLinear":
        return cls(lin.weight, lin.bias, gemv_rows, small_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.gemv_rows:
            return F.linear(x, self.weight, self.bias)
        shape = x.shape
        if rows <= self.small_rows:
            y = torch.ops.halfmoon.small_gemm(x.reshape(rows, self.in_features), self.small_packed, self.out_features,
                                              self.bias)
            return y.view(*shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, self.in_features), self.packed, self.bias,
                                               "none", [], "")
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, gemv_rows={self.gemv_rows}, "
                f"small_rows={self.small_rows}")


def release_packed_sources(model: nn.Module, packed: list[nn.Module], superseded: list[nn.Module]) -> int:
    """Free the row-major weights of ``packed`` (:class:`PackedLinear` modules with ``gemv_rows`` 0:
    they never read ``weight`` again) and of ``superseded`` (modules a fused projection replaced:
    their weights are views of the fused one and they are not called). A storage that a parameter of
    any other module of ``model`` shares (an embedding tied to ``lm_head``) is kept, and so is
    whatever oneDNN's packed tensor still aliases (its reorder can be a no-op). Released parameters
    keep their names with shape [0]; the model can no longer run unpacked. Returns the bytes whose
    last parameter reference went (an upper bound on what the process gets back)."""
    packed = [m for m in packed if isinstance(m, PackedLinear) and m.gemv_rows == 0]
    owners = {id(m) for m in packed} | {id(m) for m in superseded}
    kept = {p.untyped_storage().data_ptr() for m in model.modules() if id(m) not in owners
            for p in m.parameters(recurse=False)}
    freed: dict[int, int] = {}
    with torch.no_grad():
        for m in packed + list(superseded):
            w = m.weight
            if w.numel() == 0 or w.untyped_storage().data_ptr() in kept:
                continue
            freed[w.untyped_storage().data_ptr()] = w.untyped_storage().nbytes()
            w.data = w.new_empty(0)
    return sum(freed.values())


def trim_heap() -> None:
    """Hand free heap pages back to the OS (glibc ``malloc_trim``): part of the released weights sits
    in glibc's heap, whose mmap threshold grows while a model loads, and would stay resident (67 MB
    of a SmolLM2 worker). No-op where libc has no ``malloc_trim``."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def fused_linear(linears: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` computing ``cat([l(x) for l in linears], -1)``: the weights concatenated along
    the output dim, each original ``weight`` (and ``bias``) re-pointed at its rows of the fused
    tensor (a view: no extra memory, names unchanged). All must share ``in_features`` and all or
    none have a bias."""
    with torch.no_grad():
        w = torch.cat([lin.weight.data for lin in linears], 0)
        has_bias = linears[0].bias is not None
        b = torch.cat([lin.bias.data for lin in linears], 0) if has_bias else None
        out = nn.Linear(w.shape[1], w.shape[0], bias=has_bias, device="meta")
        out.weight = nn.Parameter(w, requires_grad=False)
        out.bias = nn.Parameter(b, requires_grad=False) if has_bias else None
        off = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = w[off:off + n]
            if has_bias:
                lin.bias.data = b[off:off + n]
            off += n
    return out


def pack_linear(lin: nn.Module, impl: CpuLinear) -> nn.Module:
    """``lin`` as ``impl`` runs it: itself for TORCH, an unsupported weight or anything but a plain
    ``nn.Linear`` (a subclass's own ``forward``, e.g. a row-parallel all-reduce, must not be
    dropped), else a PackedLinear."""
    if impl.packs and type(lin) is nn.Linear and packed_linear_supported(lin.weight):
        return PackedLinear.from_linear(lin, small_rows=impl.small_rows)
    return lin

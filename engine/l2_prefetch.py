"""L2 prefetch of a GEMM's weights while the memory bus is idle (CUDA, sm90+).

Why: in a small-batch decode step the weight GEMMs stream HBM and the kernels between them do not.
At batch 1, ctx 1k (Llama-3.1-8B shapes) the attention of a layer reads 4 MB of KV in ~10 µs while
the bus could move ~30 MB, and the o projection that follows it reads its 33.5 MB weight from HBM
afterwards. Asking the L2 (50 MB on an H100) to fetch that weight during the attention lets the o
GEMM read it from L2 instead: the step moves the same bytes, but in a window that was idle.

How: ``cp.async.bulk.prefetch.L2.global [addr], size`` (PTX ISA 8.0, sm_90): a fire-and-forget
request to the L2 for ``size`` bytes (a multiple of 16 at a 16-byte aligned address); the issuing
thread does not wait for it and nothing is written to registers or shared memory. A prefetch is a
hint: it never changes a result, so a kernel that issues it computes exactly what it did without.

Two ways to issue it:

* inside a kernel that runs in the idle window (engine.attention.split_kv_decode takes an optional
  ``prefetch`` tensor and each program asks for its share of it), no extra launch;
* :func:`prefetch_l2`: a small kernel of its own (a few CTAs), for a side stream of a CUDA graph.

:func:`byte_view` gives the flat uint8 view both take. TensorRT-LLM's low-latency GEMMs and the
"megakernel" decoders prefetch the next weights the same way.
"""

from __future__ import annotations

import os

import torch

CHUNK = 16384  # bytes a prefetch instruction asks for (a multiple of 16)
PREFETCH_ENV = "HALFMOON_L2_PREFETCH"
PREFETCH_CHOICES = ("off", "o")  # "o": the split-KV attention prefetches the layer's o_proj weight

_KERNEL = None


def prefetch_mode(value: str | None = None) -> str:
    """``HALFMOON_L2_PREFETCH`` (or ``value``): one of :data:`PREFETCH_CHOICES`, default "off".
    Raises ValueError on any other value."""
    mode = (os.environ.get(PREFETCH_ENV, "") if value is None else value) or "off"
    if mode not in PREFETCH_CHOICES:
        raise ValueError(f"{PREFETCH_ENV}={mode!r}: expected one of {PREFETCH_CHOICES}")
    return mode


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a flat uint8 tensor over the same memory. Raises ValueError when ``t``
    is not contiguous or its storage offset is not 16-byte aligned (what the PTX requires)."""
    if not t.is_contiguous():
        raise ValueError("L2 prefetch: the tensor must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError("L2 prefetch: the tensor must start at a 16-byte aligned address")
    return t.view(-1).view(torch.uint8)


def chunks_per_program(nbytes: int, programs: int, chunk: int = CHUNK) -> int:
    """Prefetch instructions a program issues so that ``programs`` of them cover ``nbytes``: a power
    of two (``tl.arange``'s size); the programs past the end re-ask for the last chunk."""
    want = -(-nbytes // (programs * chunk))
    return 1 << max(0, (want - 1).bit_length())


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_kernel(buf, nbytes, per_prog, CHUNKS: tl.constexpr, CHUNK_B: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * per_prog
        off = start + tl.arange(0, CHUNKS).to(tl.int64) * CHUNK_B
        off = tl.minimum(off, nbytes - CHUNK_B)  # in bounds: past the end re-asks for the last chunk
        size = tl.full([CHUNKS], CHUNK_B, tl.int32)
        # $1 the address (64-bit), $2 the size (32-bit), $3 the element count, $0 a dummy result (inline
        # asm needs one); not pure, so the compiler keeps it although the result is unused. A tensor
        # smaller than the CTA is replicated (thread t holds element t % CHUNKS): only threads below
        # CHUNKS issue, so each chunk is asked for once
        tl.inline_asm_elementwise("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, $3; "
                                  "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }", "=r,l,r,r",
                                  [buf + off, size, tl.full([CHUNKS], CHUNKS, tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)

    return prefetch_kernel


def prefetch_l2(t: torch.Tensor, ctas: int = 16, chunk: int = CHUNK) -> None:
    """Ask the L2 for all of ``t`` (a CUDA tensor, contiguous, at least ``chunk`` bytes) from a
    ``ctas``-CTA kernel on the current stream; returns at once (the kernel issues the requests and
    exits, the L2 fills behind it). Raises ValueError as :func:`byte_view`."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _build()
    buf = byte_view(t)
    n = buf.numel() - buf.numel() % chunk
    if n < chunk:
        return
    per = -(-n // (ctas * chunk)) * chunk
    _KERNEL[(ctas,)](buf, n, per, CHUNKS=chunks_per_program(n, ctas, chunk), CHUNK_B=chunk, num_warps=1)


__all__ = ["CHUNK", "PREFETCH_CHOICES", "PREFETCH_ENV", "byte_view", "chunks_per_program", "prefetch_l2",
           "prefetch_mode"]

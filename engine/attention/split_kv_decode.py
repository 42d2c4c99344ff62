"""Split-KV paged decode attention in one Triton kernel (CUDA): the partials are merged in the kernel.

One query token per request attends to its row ``req_to_token[row, 0:seq_len]`` of one layer's pool.
Grid ``(B * kv_heads, S)``: program ``(b, h, s)`` takes the ``s``-th chunk of request ``b``'s tokens
for KV head ``h`` and all ``G = num_heads / kv_heads`` query heads that share it (GQA: query head
``h * G + g`` reads KV head ``h``), in tiles of ``block_n`` tokens with an online softmax (running
max ``m``, sum ``l``, unnormalised output). With ``S = 1`` it writes the output directly. With
``S > 1`` it writes its ``(m, l, acc)`` to a float32 workspace, then takes a ticket from a per-(b, h)
counter; the program that draws the last ticket merges the ``S`` partials by their log-sum-exp
(FlashAttention's split-KV / flash-decoding merge) and resets the counter for the next launch.

Why: in a CUDA-graph decode step at batch 1, ctx 1k (Llama-3.1-8B heads on an H200) flashinfer's
graph-mode decode wrapper spent 10.1 us a layer in its split-KV kernel and 2.3 us in a separate merge
kernel for 4 MB of KV (~0.4 ms of a 4.7 ms step, 0.03 ms of bytes), and the graph also gathers the
page table with ~8 small kernels and the host plans the wrapper before every replay
(bench/results/GPU_NOTES.md, sessions 11 and 13). This kernel reads token slots straight from
``req_to_token`` (no page table, no plan) and needs one launch a layer; TensorRT-LLM's XQA merges
in-kernel the same way ("last CTA" of each (request, kv head)).

Slots: token ``t`` of a row is at ``slot = req_to_token[row, t]``, i.e. page ``slot // page_size``,
offset ``slot % page_size`` of the ``[num_pages, page_size, kv_heads, head_dim]`` views (strided in
the page-major pool; any strides with a contiguous last dim). The tokens' K/V must be stored before
the launch (the fused RoPE + K/V store, or ``KVPool.write``).

Numerics: scores and softmax in float32 (exp2 with ``log2(e)`` folded into the scale), the
probabilities rounded to the K/V dtype before the P·V product (as flash attention does), one
rounding of the output. Triton is imported on first use; with ``TRITON_INTERPRET=1`` the kernel runs
on CPU tensors (float16: the interpreter has no bfloat16), which the unit tests do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_KERNEL = None
_LOG2E = 1.4426950408889634
MAX_SPLITS = 32
MAX_GROUP = 16  # query heads per KV head: the q tile is padded to 16 rows (tl.dot's minimum)


@dataclass(frozen=True)
class SplitConfig:
    """Launch shape: ``block_n`` tokens a tile (a power of two >= 16), ``warps``, ``stages`` (software
    pipelining depth of the tile loop), ``ctas_per_sm``: :func:`num_splits` aims at this many
    programs per SM. :func:`default_config` picks one per batch size."""

    block_n: int = 64
    warps: int = 4
    stages: int = 3
    ctas_per_sm: int = 1


# The fastest shapes of 12 (32/64 tokens x 2/3 stages x 1/2/4 programs an SM) in
# ``python -m bench.gpu split_kv_micro`` on an H200 (bench/results/GPU_NOTES.md, session 17 call 2):
# below 32 requests three stages and two programs an SM (32 splits at B=1: 10.0 / 14.6 us a layer at
# ctx 1k / 4k, against 9.9 / 17.0 with one program an SM); from 32 requests two stages (a program's
# three-stage K/V ring, 96 KB of shared memory, leaves one program an SM where two stages leave
# three: B=128 133.0 against 142.9 us at ctx 1k, 503 against 544 at 4k; B=32 41.6 / 133.7 with 2 splits).
SMALL_BATCH_CONFIG = SplitConfig(block_n=64, stages=3, ctas_per_sm=2)
LARGE_BATCH_CONFIG = SplitConfig(block_n=64, stages=2, ctas_per_sm=2)
LARGE_FROM_BATCH = 32
# From 32 to 47 requests: 128-token tiles and one program an SM, so one split (no partials, no
# merge) and half as many loop steps. In a 44-shape sweep on an H100 it was the fastest at B=32
# ctx 1k: 49.2 against 52.5 µs a layer for LARGE_BATCH_CONFIG's two splits (2.72 against 2.55 TB/s
# of 134 MB), but 8.7 % slower at B=64 (its 128 KB ring leaves one program an SM).
# In the captured decode step at B=32 (H100, two runs) it saves 0.04 ms at ctx 1k and 0.09 ms at 4k.
MID_BATCH_CONFIG = SplitConfig(block_n=128, stages=2, ctas_per_sm=1)
MID_BATCH_ROWS = (LARGE_FROM_BATCH, 47)


def default_config(batch: int) -> SplitConfig:
    """The launch shape for ``batch`` requests: :data:`MID_BATCH_CONFIG` within
    :data:`MID_BATCH_ROWS` (inclusive), else :data:`LARGE_BATCH_CONFIG` from
    :data:`LARGE_FROM_BATCH` up, else :data:`SMALL_BATCH_CONFIG`."""
    if MID_BATCH_ROWS[0] <= batch <= MID_BATCH_ROWS[1]:
        return MID_BATCH_CONFIG
    return LARGE_BATCH_CONFIG if batch >= LARGE_FROM_BATCH else SMALL_BATCH_CONFIG


def num_splits(batch: int, kv_heads: int, sms: int, ctas_per_sm: int = 1) -> int:
    """Chunks per (request, KV head): enough programs for ``ctas_per_sm * sms`` (a batch too small to
    fill the GPU splits each row), 1 to :data:`MAX_SPLITS`. A fixed count per batch size, so a CUDA
    graph captured at that batch size stays valid for any lengths."""
    want = -(-ctas_per_sm * sms // max(1, batch * kv_heads))
    return max(1, min(MAX_SPLITS, want))


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kv_decode_kernel(q, kc, vc, r2t, rows, seq_lens, out, part_acc, part_ml, counter,
                               sq_b, sq_h, sk_p, sk_t, sk_h, sv_p, sv_t, sv_h, s_r2t, so_b, so_h, scale_log2,
                               KVH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                               PS: tl.constexpr, BLOCK_N: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                               PDL: tl.constexpr):
        if PDL:  # let the next kernel launch now: it waits for this grid's completion before it reads
            tl.extra.cuda.gdc_launch_dependents()
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // KVH
        h = bh % KVH
        seq = tl.load(seq_lens + b).to(tl.int64)
        row = tl.load(rows + b).to(tl.int64)
        if PDL:  # q and the new token's K/V come from the kernel before (the fused RoPE + K/V store)
            tl.extra.cuda.gdc_wait()
        chunk = tl.cdiv(tl.cdiv(seq, S), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, seq)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < G
        qh = h * G + g
        qt = tl.load(q + b * sq_b + qh[:, None] * sq_h + d[None, :], mask=gmask[:, None], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        l = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            # through int32 (slots are < 2**31): from a raw int64 load the compiler keeps the page,
            # offset and address math per token in 64 bits, which made the kernel ~1.9x slower on the
            # engine's int64 req_to_token at B >= 64 (bench.gpu split_kv_factors)
            slot = tl.load(r2t + row * s_r2t + n, mask=nmask, other=0).to(tl.int32).to(tl.int64)
            page = slot // PS
            off = slot % PS
            kt = tl.load(kc + (page * sk_p + off * sk_t + h * sk_h)[:, None] + d[None, :],
                         mask=nmask[:, None], other=0.0)
            s = tl.dot(qt, tl.trans(kt)) * scale_log2  # [GP, BLOCK_N], log2 units
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            l = l * alpha + tl.sum(p, 1)
            vt = tl.load(vc + (page * sv_p + off * sv_t + h * sv_h)[:, None] + d[None, :],
                         mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m = m_new
        o_ptr = out + b * so_b + qh[:, None] * so_h + d[None, :]
        if S == 1:
            tl.store(o_ptr, (acc / tl.where(gmask, l, 1.0)[:, None]).to(out.dtype.element_ty), mask=gmask[:, None])
        else:
            pg = (bh * G + g) * S + split  # partials laid out [b, h, g, split]: a merge reads [S, D] at once
            tl.store(part_acc + pg[:, None] * D + d[None, :], acc, mask=gmask[:, None])
            tl.store(part_ml + pg * 2, m, mask=gmask)
            tl.store(part_ml + pg * 2 + 1, l, mask=gmask)
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            ticket = tl.atomic_add(counter + bh, 1, sem="acq_rel")
            if ticket == S - 1:  # the last program of (b, h): merge the S partials, one query head at a time
                sp = tl.arange(0, SP)
                smask = sp < S
                for gi in tl.static_range(G):
                    pi = (bh * G + gi) * S + sp
                    mi = tl.load(part_ml + pi * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
                    li = tl.load(part_ml + pi * 2 + 1, mask=smask, other=0.0, cache_modifier=".cg")
                    ai = tl.load(part_acc + pi[:, None] * D + d[None, :], mask=smask[:, None], other=0.0,
                                 cache_modifier=".cg")
                    w = tl.exp2(mi - tl.max(mi, 0))  # an empty chunk (m = -inf, l = 0) weighs 0
                    o = tl.sum(ai * w[:, None], 0) / tl.sum(li * w, 0)
                    tl.store(out + b * so_b + (h * G + gi) * so_h + d, o.to(out.dtype.element_ty))
                tl.atomic_xchg(counter + bh, 0)  # ready for the next launch (graph replays reuse it)

    return split_kv_decode_kernel


class SplitKVDecode:
    """Workspace and launcher of the kernel for one engine (one pool's shapes, batches up to
    ``max_batch``).

    ``num_heads``, ``kv_heads``, ``head_dim`` (a power of two), ``page_size``: the model's and pool's;
    ``device``: the pool's; ``sms``: streaming multiprocessors (default: the device's);
    ``config``: one :class:`SplitConfig` for every batch size (default: :func:`default_config` of
    each launch's batch size). Raises ValueError for a GQA group above :data:`MAX_GROUP`, a
    head count not divisible by ``kv_heads``, or ``head_dim`` not a power of two >= 16.
    """

    def __init__(self, num_heads: int, kv_heads: int, head_dim: int, page_size: int, max_batch: int,
                 device: torch.device | str, scale: float | None = None, sms: int | None = None,
                 config: SplitConfig | None = None):
        if num_heads % kv_heads or num_heads // kv_heads > MAX_GROUP:
            raise ValueError(f"split-KV decode: {num_heads} query heads over {kv_heads} KV heads "
                             f"(at most {MAX_GROUP} a KV head, evenly)")
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"split-KV decode: head_dim {head_dim} is not a power of two >= 16")
        self.h, self.kvh, self.d, self.ps = num_heads, kv_heads, head_dim, page_size
        self.group = num_heads // kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.device = torch.device(device)
        if sms is None:
            sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                   if self.device.type == "cuda" else 132)
        self.sms, self.config = sms, config
        most = max(b * num_splits(b, kv_heads, sms, self.config_for(b).ctas_per_sm) for b in range(1, max_batch + 1))
        rows = most * kv_heads * self.group  # (b, h, split, g) partials, every batch size at most this
        self.part_acc = torch.empty(rows * head_dim, dtype=torch.float32, device=self.device)
        self.part_ml = torch.empty(rows * 2, dtype=torch.float32, device=self.device)
        self.counter = torch.zeros(max_batch * kv_heads, dtype=torch.int32, device=self.device)

    def config_for(self, batch: int) -> SplitConfig:
        """The launch shape of a ``batch``-request launch."""
        return self.config if self.config is not None else default_config(batch)

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                 req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                 out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
        """Attention of ``q`` [B, num_heads, head_dim] (fp16/bf16, any row and head strides, last dim
        contiguous) over each request's row: ``rows`` int64 [B] into ``req_to_token`` (int32/int64
        [rows, max_context], slots below 2**31), ``seq_lens`` int32/int64 [B] (>= 1, the new token's K/V already stored);
        ``k_pages``/``v_pages`` [num_pages, page_size, kv_heads, head_dim] of the q dtype.
        Returns ``out`` [B, num_heads, head_dim] (new when None). Launches one kernel, no host sync.

        ``pdl``: launch it with programmatic dependent launch (CUDA, sm90+): it may start while the
        kernel before it runs, reads ``seq_lens`` and ``rows`` then, and waits for that kernel
        before anything else, so those two (and the pool's earlier tokens) must not be written by
        the kernel just before it (the graphs write them before the step); it also lets the kernel
        after it launch at once (that kernel must wait, as tinygemm and flashinfer's PDL kernels do)."""
        global _KERNEL
        if _KERNEL is None:
            _KERNEL = _build()
        B = q.shape[0]
        if out is None:
            out = torch.empty(B, self.h, self.d, dtype=q.dtype, device=q.device)
        c = self.config_for(B)
        S = num_splits(B, self.kvh, self.sms, c.ctas_per_sm)
        _KERNEL[(B * self.kvh, S)](
            q, k_pages, v_pages, req_to_token, rows, seq_lens, out, self.part_acc, self.part_ml, self.counter,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), req_to_token.stride(0),
            out.stride(0), out.stride(1), self.scale * _LOG2E,
            KVH=self.kvh, G=self.group, GP=MAX_GROUP, D=self.d, PS=self.ps, BLOCK_N=c.block_n, S=S,
            SP=max(2, 1 << (S - 1).bit_length()), PDL=pdl,
            num_warps=c.warps, num_stages=c.stages, **({"launch_pdl": True} if pdl else {}))
        return out


def reference(q, k_pages, v_pages, req_to_token, rows, seq_lens, scale: float | None = None) -> torch.Tensor:
    """The same attention in float32 torch, request by request (for tests): [B, H, D] float32."""
    B, H, D = q.shape
    kvh, ps = k_pages.shape[2], k_pages.shape[1]
    scale = D ** -0.5 if scale is None else scale
    outs = []
    for i in range(B):
        slots = req_to_token[int(rows[i]), : int(seq_lens[i])].long()
        k = k_pages[slots // ps, slots % ps].float()  # [T, kvh, D]
        v = v_pages[slots // ps, slots % ps].float()
        k = k.repeat_interleave(H // kvh, dim=1)
        v = v.repeat_interleave(H // kvh, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        outs.append(torch.einsum("ht,thd->hd", torch.softmax(s, -1), v))
    return torch.stack(outs)


__all__ = ["SplitConfig", "SplitKVDecode", "default_config", "SMALL_BATCH_CONFIG", "LARGE_BATCH_CONFIG",
           "MID_BATCH_CONFIG", "MID_BATCH_ROWS",
           "LARGE_FROM_BATCH", "num_splits", "reference", "MAX_SPLITS", "MAX_GROUP"]

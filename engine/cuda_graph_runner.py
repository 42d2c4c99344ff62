"""CUDA graphs for decode batches: one graph per batch-size bucket, replayed with fresh inputs.

A decode step of a 7-8B model is ~400 short kernels; launched one by one from Python the launch
gaps cost more than the memory traffic at small batch. Capturing the whole forward (embedding,
every layer, final norm, lm_head) once per bucket and replaying it removes them.

Per step (:meth:`CudaGraphRunner.replay`), outside the graph: copy input ids / positions /
``out_cache_loc`` / request rows into the static buffers (device-to-device, padded to the bucket)
and ``plan`` the bucket's graph-mode flashinfer decode wrapper from host-side lengths
(``ForwardBatch.seq_lens_cpu``: page counts -> ``indptr``, ``last_page_len``), then replay. The page
ids themselves are gathered *inside* the graph (:meth:`CudaGraphRunner._fill_page_ids`, fixed shape
``[b * pages_per_row]``) from ``req_to_token`` and the planned ``indptr``, so the host launches no
page-table kernels per step. Nothing in a step waits for the device; the caller's sampling (argmax /
sampler on the device) is the step's only sync.

Padding: a batch of B requests runs in the smallest bucket b >= B; the b - B pad entries have
length 1 and read one page of request row 0 (read only, their outputs are dropped) and store their
K/V in a scratch page that no request owns (``ModelRunner`` allocates the KV pool one page larger
than the allocator's).

Tensor parallelism (``runner.tp`` set, NCCL): every rank builds this runner at start-up and
captures the same buckets in the same order, so each graph holds the same all-reduces (and the
lm_head's gather) on every rank; ProcessGroupNCCL captures them once its communicator exists
(warmed by an eager collective first, as sglang / vLLM do before their ``graph_capture``). Per step
rank 0 picks the bucket and sends it with the batch (``engine.distributed.batch_wire``); followers
replay that bucket (``replay(batch, bucket)``), padding with their own scratch page (the same page
index on every rank: the pools have the same pages).

Decode attention in each bucket's graph (:func:`decode_attention`): "flashinfer" is the graph-mode
decode wrapper above; "split_kv" is engine.attention.split_kv_decode, one Triton kernel a layer that
reads the token slots from ``req_to_token`` and the lengths from ``seq_lens`` on the device: no plan,
no page-table gather, and the replay copies ``seq_lens`` with the other inputs.

After sglang's ``cuda_graph_runner.py`` (buckets, padding, plan-before-replay) and flashinfer's
``use_cuda_graph`` decode wrappers.
"""

from __future__ import annotations

import bisect
import contextlib
import os

import torch

from engine.attention.base import AttentionBackend
from engine.attention.flashinfer_backend import FlashInferAttentionBackend, page_counts
from engine.forward_batch import ForwardBatch, ForwardMode

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# Buckets from this size up are captured under cuBLASLt: on the H200 (Llama-3.1-8B shapes) its o and
# down kernels at M = 32-128 beat cuBLAS's (B=32 -0.07, B=64 -0.15 to -0.18, B=128 ctx 4k -0.1 to
# -0.19 ms a step), while at B=16 it lost 0.07 ms and at B <= 8 the two are equal (o/down run on
# tinygemm there; bench/results/GPU_NOTES.md session 13, call 6). It applies on every GPU and dtype;
# only the H200 with bf16 Llama-8B shapes was measured.
CUBLASLT_FROM_BUCKET = 32
GRAPH_BLAS_CHOICES = ("cublas", "cublaslt")
DECODE_ATTN_CHOICES = ("flashinfer", "split_kv")
# Buckets that attend with engine.attention.split_kv_decode when HALFMOON_DECODE_ATTN is unset: those
# whose graph replay (Llama-3.1-8B shapes, bf16, per-batch launch shape) beat flashinfer's wrapper in
# both of two interleaved runs at ctx 1k and 4k on an H100 (bench/results/GPU_NOTES.md, session 20):
# e.g. B=32 7.65 vs 7.88 ms at 1k and 11.73-11.76 vs 12.03 at 4k, B=64 9.01 vs 9.40 and 17.11-17.13
# vs 17.55, B=128 12.11 vs 12.61 at 1k (96 and 128 measured at 1k only), or that tied at 4k and won
# at 1k: B=1 (±4 us at 4k, as on the H200 in session 17) and B=4 (+6, +7, +8, -11 us at 4k and -23
# to -46 us at 1k over four runs on two H100s, sessions 20 and 21; the synced step 0.18-0.6 ms
# shorter: no host plan). Buckets above 128 were not measured and keep the wrapper.
SPLIT_KV_BUCKETS = frozenset({1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128})


def decode_attention(bucket: int, env: str | None = None) -> str:
    """The decode attention kernel captured in ``bucket``'s graph: ``env`` (default:
    ``HALFMOON_DECODE_ATTN``) for every bucket when set, else "split_kv" in
    :data:`SPLIT_KV_BUCKETS` and "flashinfer" elsewhere. Raises ValueError on a value not in
    :data:`DECODE_ATTN_CHOICES`."""
    env = os.environ.get("HALFMOON_DECODE_ATTN", "") if env is None else env
    if env:
        if env not in DECODE_ATTN_CHOICES:
            raise ValueError(f"HALFMOON_DECODE_ATTN={env!r}: expected one of {DECODE_ATTN_CHOICES}")
        return env
    return "split_kv" if bucket in SPLIT_KV_BUCKETS else "flashinfer"


def decode_pdl(env: str | None = None) -> bool:
    """Whether the graphs' split-KV buckets launch the fused RoPE + K/V store and the attention
    kernel with programmatic dependent launch (sm90+): on unless ``env`` (default
    ``HALFMOON_DECODE_PDL``) is "0"; "1" or unset is on (on sm90+ GPUs only: the graph runner
    turns it off below that, or refuses "1"). Each of the two lets the next kernel launch
    while it runs and waits for the one before it, so the attention's launch and first loads overlap
    the store, and tinygemm's o_proj (itself launched that way at <= 8 rows) starts streaming its
    weight before the attention ends. Measured (Llama-3.1-8B shapes, bf16, one H100, two
    interleaved runs, bench/results/GPU_NOTES.md session 22): the replay was shorter in all 22 cells
    (B = 1, 4, 8, 32, 64 at ctx 1k and 4k and B=128 at 1k): -0.04 to -0.07 ms at B = 1-4 ctx 1k,
    -0.08 to -0.10 at B=8 1k, -0.19 to -0.24 at B=8 4k, -0.015 to -0.07 from B=32 up; a third run
    on another H100 agreed in 8 of 9 cells, B=64 ctx 4k +0.014 ms (a tie there). Raises
    ValueError on any other value."""
    env = os.environ.get("HALFMOON_DECODE_PDL", "") if env is None else env
    if env not in ("", "0", "1"):
        raise ValueError(f"HALFMOON_DECODE_PDL={env!r}: expected 0 or 1")
    return env != "0"


def graph_blas(bucket: int, env: str = "") -> str:
    """The BLAS library torch calls for the GEMMs captured in ``bucket``'s graph: ``env`` (the value
    of ``HALFMOON_DECODE_GRAPH_BLAS``) when set, else "cublaslt" from :data:`CUBLASLT_FROM_BUCKET`
    up and "cublas" below. Raises ValueError on any other ``env`` value."""
    if env:
        if env not in GRAPH_BLAS_CHOICES:
            raise ValueError(f"HALFMOON_DECODE_GRAPH_BLAS={env!r}: expected one of {GRAPH_BLAS_CHOICES}")
        return env
    return "cublaslt" if bucket >= CUBLASLT_FROM_BUCKET else "cublas"


def _scope(tuned, rows: int, tune: bool):
    """The tuned GEMM's scope for a bucket of ``rows`` (engine.tuned_gemm), or nothing when it is off."""
    return contextlib.nullcontext() if tuned is None else tuned.scope(rows, tune)


class _Planned(AttentionBackend):
    """The backend with ``init_forward`` skipped: the graph runner planned the wrapper already.
    Everything else (``forward``, ``attend``, ``has_attend``, the pools) is the backend's own, so the
    model sees the same backend interface inside and outside a graph."""

    def __init__(self, backend: FlashInferAttentionBackend, wrapper):
        super().__init__(backend.kv_pool, backend.req_to_token_pool, backend.num_heads, backend.num_kv_heads,
                         backend.head_dim, backend.scale)
        self.backend, self.wrapper = backend, wrapper
        self.has_attend = backend.has_attend

    def init_forward(self, batch) -> None:
        self.backend.set_wrapper(self.wrapper)

    def forward(self, q, k, v, layer, batch):
        return self.backend.forward(q, k, v, layer, batch)

    def attend(self, q, k, v, layer, batch):
        return self.backend.attend(q, k, v, layer, batch)


class _SplitKV(AttentionBackend):
    """The backend with decode attention on engine.attention.split_kv_decode: K/V stores are the
    backend's own (``store_kv``, or the caller's fused RoPE + store before ``attend``)."""

    has_attend = True

    def __init__(self, backend: FlashInferAttentionBackend, kernel, pdl: bool = False):
        super().__init__(backend.kv_pool, backend.req_to_token_pool, backend.num_heads, backend.num_kv_heads,
                         backend.head_dim, backend.scale)
        self.kernel = kernel
        self.pdl = pdl  # AttentionBackend.pdl: the fused ops' RoPE + K/V store is launched the same way

    def init_forward(self, batch) -> None:
        pass  # nothing to plan: the kernel reads req_to_token and seq_lens on the device

    def forward(self, q, k, v, layer, batch):
        self.store_kv(layer, batch, k, v)
        return self.attend(q, k, v, layer, batch)

    def attend(self, q, k, v, layer, batch):
        o = self.kernel(q, self.kv_pool.k_pages(layer), self.kv_pool.v_pages(layer),
                        self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens,
                        pdl=self.pdl)
        return o.view(q.shape[0], self.num_heads * self.head_dim)


class CudaGraphRunner:
    """Captures ``runner.model`` decode forwards for each bucket <= ``max_batch``.

    ``runner``: an :class:`engine.model_runner.ModelRunner` on CUDA with the flashinfer backend and a
    scratch page (``runner.scratch_page``). Raises ValueError otherwise.
    """

    def __init__(self, runner, max_batch: int | None = None, buckets=DEFAULT_BUCKETS):
        if not isinstance(runner.backend, FlashInferAttentionBackend):
            raise ValueError("cuda graphs need the flashinfer attention backend")
        if getattr(runner, "scratch_page", None) is None:
            raise ValueError("cuda graphs need a scratch page in the KV pool (ModelRunner(cuda_graph=True))")
        self.runner = runner
        self.backend: FlashInferAttentionBackend = runner.backend
        self.model = runner.model
        self.page_size = ps = runner.page_size
        max_batch = max_batch or runner.config.max_running_requests
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        dev = self.device = runner.device
        self.scratch_page = runner.scratch_page
        self.scratch_slot = runner.scratch_page * ps
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(max_batch, **i64)
        self.positions = torch.zeros(max_batch, **i64)
        self.rows = torch.zeros(max_batch, **i64)
        self.seq_lens = torch.ones(max_batch, **i64)
        self.ones = torch.ones(max_batch, **i64)
        self.zeros = torch.zeros(max_batch, **i64)
        self.out_cache_loc = torch.full((max_batch,), self.scratch_slot, **i64)
        self.pages_per_row = pages_per_row = -(-runner.max_context // ps)
        self.max_context = runner.max_context
        self.indices = torch.zeros(max_batch * pages_per_row + max_batch, dtype=torch.int32, device=dev)
        # j: flat page-table position (int32 like flashinfer's indptr: searchsorted wants one dtype)
        self.page_slot = torch.arange(max_batch * pages_per_row, dtype=torch.int32, device=dev)
        self.indptr: dict[int, torch.Tensor] = {}  # per bucket: int32 [b + 1], written by plan
        self.wrappers: dict[int, object] = {}
        self._no_indices = torch.empty(0, dtype=torch.int32, device=dev)  # plan copies no page ids
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.split_kv = None  # the kernel, made when some bucket uses it
        self.attn = {b: decode_attention(b) for b in self.buckets}  # per bucket: "flashinfer" | "split_kv"
        # the split-KV buckets' store and attention kernels; griddepcontrol needs sm90+
        major, minor = torch.cuda.get_device_capability(dev)
        sm90 = major >= 9
        if os.environ.get("HALFMOON_DECODE_PDL", "") == "1" and not sm90:
            raise ValueError(f"HALFMOON_DECODE_PDL=1 needs an sm90+ GPU (programmatic dependent launch); "
                             f"{torch.cuda.get_device_name(dev)} is sm{major}{minor}")
        self.pdl = decode_pdl() and sm90
        if "split_kv" in self.attn.values():
            from engine.attention.split_kv_decode import SplitKVDecode

            be = self.backend
            self.split_kv = SplitKVDecode(be.num_heads, be.num_kv_heads, be.head_dim, ps, max_batch, dev,
                                          scale=be.scale)
        if getattr(runner, "tp", None) is not None:
            # an eager collective first: the NCCL communicator exists before any capture, and every
            # rank starts capturing together; then no collective work is in flight during capture
            runner.tp.min_int(0)
            torch.cuda.synchronize(dev)
        with torch.inference_mode():
            for b in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                self._capture(b)

    def bucket_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode is ForwardMode.DECODE and batch.batch_size <= self.max_batch

    def _static_batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(mode=ForwardMode.DECODE, input_ids=self.input_ids[:b], positions=self.positions[:b],
                            req_pool_indices=self.rows[:b], seq_lens=self.seq_lens[:b],
                            prefix_lens=self.zeros[:b], extend_lens=self.ones[:b],
                            out_cache_loc=self.out_cache_loc[:b])

    def _plan(self, b: int, batch: ForwardBatch | None) -> None:
        """Plan bucket ``b``'s wrapper from host-side lengths: the batch's B requests, then b - B
        one-token pad entries. Page ids are not passed: the graph gathers them (``_fill_page_ids``)."""
        seq = torch.ones(b, dtype=torch.int64)
        if batch is not None and batch.batch_size:
            seq[: batch.batch_size] = batch.host_lens()[0]
        indptr, last = page_counts(seq, self.page_size)
        self.backend.plan_decode(self.wrappers[b], indptr, self._no_indices, last)

    def _fill_page_ids(self, b: int) -> None:
        """(Captured in the graph.) Page ids of bucket ``b``'s rows into ``self.indices``: flat
        position j of the page table belongs to entry i = searchsorted(indptr, j, right) - 1 and is
        page (j - indptr[i]) of row ``rows[i]``, i.e. ``req_to_token[rows[i], (j - indptr[i]) * ps] // ps``.
        Computed for all ``b * pages_per_row`` positions (a fixed shape); positions past ``indptr[b]``
        get clamped, unused values."""
        indptr = self.indptr[b]
        j = self.page_slot[: b * self.pages_per_row]
        entry = (torch.searchsorted(indptr, j, right=True) - 1).clamp_(0, b - 1)
        pos = ((j - indptr[entry]) * self.page_size).clamp_(0, self.max_context - 1).long()
        r2t = self.runner.req_to_token_pool.req_to_token
        pages = torch.div(r2t[self.rows[:b][entry], pos], self.page_size, rounding_mode="floor")
        self.indices[: j.numel()].copy_(pages)

    def _page_ids(self, b: int) -> None:
        if self.attn[b] == "flashinfer":  # the split-KV kernel reads req_to_token itself
            self._fill_page_ids(b)

    def _capture(self, b: int) -> None:
        # the BLAS library of the captured GEMMs (see graph_blas) is baked into the graph
        lib = graph_blas(b, os.environ.get("HALFMOON_DECODE_GRAPH_BLAS", ""))
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(lib)
        try:
            self._capture_with_current_blas(b)
        finally:
            torch.backends.cuda.preferred_blas_library(before)

    def _capture_with_current_blas(self, b: int) -> None:
        if self.attn[b] == "flashinfer":
            self.indptr[b] = torch.zeros(b + 1, dtype=torch.int32, device=self.device)
            self.wrappers[b] = self.backend.make_decode_wrapper(b, self.indices, self.indptr[b])
            self._plan(b, None)
            planned = _Planned(self.backend, self.wrappers[b])
        else:
            planned = _SplitKV(self.backend, self.split_kv, self.pdl)
        batch = self._static_batch(b)
        tuned = getattr(getattr(self.model, "_fused", None), "tuned", None)  # engine.tuned_gemm, or None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # warm-up outside the graph (cuBLAS handles, lazy inits; the tuned GEMM times its candidates)
        with torch.cuda.stream(stream), _scope(tuned, b, tune=True):
            for _ in range(2):
                self._page_ids(b)
                self.model(batch, planned)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        # TP: "thread_local" so that ProcessGroupNCCL's watchdog thread may still query the events of
        # collectives enqueued before the capture (global mode would fail the capture on that)
        mode = "thread_local" if getattr(self.runner, "tp", None) is not None else "global"
        with torch.cuda.graph(g, pool=self.mempool, capture_error_mode=mode), _scope(tuned, b, tune=False):
            self._page_ids(b)
            self.logits[b] = self.model(batch, planned)
        self.graphs[b] = g

    def replay(self, batch: ForwardBatch, bucket: int | None = None) -> torch.Tensor:
        """Run a decode batch through its bucket's graph (``bucket``: the one rank 0 chose under
        tensor parallelism; default the smallest that holds the batch); returns float32 logits
        [B, vocab] ([B, 0] on a follower rank).

        The result is a view of the graph's static output: consume it before the next replay.
        Raises ValueError when the batch exceeds the bucket or ``bucket`` was not captured.
        """
        B = batch.batch_size
        b = self.bucket_for(B) if bucket is None else bucket
        if b is None or b not in self.graphs or B > b:
            raise ValueError(f"decode batch of {B} does not fit captured bucket "
                             f"{b if b is not None else self.max_batch} (buckets {self.buckets})")
        self.input_ids[:B].copy_(batch.input_ids, non_blocking=True)
        self.positions[:B].copy_(batch.positions, non_blocking=True)
        self.out_cache_loc[:B].copy_(batch.out_cache_loc, non_blocking=True)
        self.rows[:B].copy_(batch.req_pool_indices, non_blocking=True)
        if b > B:
            self.input_ids[B:b].zero_()
            self.positions[B:b].zero_()
            self.rows[B:b].zero_()
            self.out_cache_loc[B:b].fill_(self.scratch_slot)
        if self.attn[b] == "flashinfer":
            self._plan(b, batch)
        else:  # the kernel's lengths come from the device: pad entries read one token of row 0
            self.seq_lens[:B].copy_(batch.seq_lens, non_blocking=True)
            self.seq_lens[B:b].fill_(1)
        self.graphs[b].replay()
        return self.logits[b][:B]

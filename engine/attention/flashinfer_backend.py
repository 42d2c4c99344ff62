"""The ``flashinfer`` attention backend (CUDA): paged prefill over a cached prefix and paged decode.

The pool's per-layer buffers ``[num_pages * page_size, kv_heads, head_dim]`` are viewed, without a
copy, as flashinfer's NHD paged layout ``[num_pages, page_size, kv_heads, head_dim]``; a request's
page table is its ``req_to_token`` row read every ``page_size`` positions (slot // page_size), which is
valid because the allocator hands out whole pages filled in order (engine/kvcache/page_allocator.py).

* EXTEND, ``extend_mode="ragged"`` (default): the new tokens attend to each other straight from the
  q/k/v tensors (``BatchPrefillWithRaggedKVCacheWrapper``, causal; flashinfer picks its FA3 kernels on
  Hopper), and, when any request has a cached prefix, to their prefix pages in the pool
  (``BatchPrefillWithPagedKVCacheWrapper`` over ``[0, pre_len)``, not causal); the two partial results
  are merged by their log-sum-exp (``merge_state_in_place``). This is sglang's ragged + paged split
  (``flashinfer_backend.py``, "use_ragged"), and FlashAttention's split-KV merge (Dao et al. 2023).
* EXTEND, ``extend_mode="paged"``: one ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True``
  over ``[0, seq_len)`` of each row; flashinfer aligns the causal mask bottom-right, so the
  ``extend_len`` queries at positions ``prefix_len..seq_len-1`` see the whole cached prefix.
* DECODE: ``BatchDecodeWithPagedKVCacheWrapper`` with tensor-core kernels (3.1-4.1 TB/s of KV read on
  an H200 vs 2.3-2.8 for the CUDA-core ones; bench/results/GPU_NOTES.md). The
  :class:`engine.cuda_graph_runner.CudaGraphRunner`
  builds its own graph-mode decode wrappers and calls :meth:`plan_decode` before each replay.

New K/V are stored first, then attention reads the pool: :meth:`forward` stores them
(``KVPool.write``), :meth:`attend` is for a caller that stored them itself (the fused RoPE + K/V store
of engine.fused_ops, one kernel per layer). ``plan`` happens once per batch in :meth:`init_forward` from host-side lengths
(``ForwardBatch.seq_lens_cpu``); the page indices themselves are gathered on the device. Every plan
goes through a :class:`PlanFence`: flashinfer stages each plan's schedule in one pinned host buffer
per wrapper, so a wrapper is not re-planned before the device has copied its previous schedule.
flashinfer is imported lazily, so this module imports on CPU-only machines.
Modelled on flashinfer ``decode.py`` / ``prefill.py`` wrappers (plan/run), sglang's
``flashinfer_backend.py`` (page-table construction, cuda-graph wrappers).
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend
from engine.forward_batch import ForwardBatch, ForwardMode

EXTEND_MODES = ("ragged", "paged")
WORKSPACE_BYTES = 256 << 20  # flashinfer's float workspace (split-kv partial outputs); 128 MiB recommended


def default_prefill_backend(device: torch.device) -> str:
    """Paged prefill kernels when none is asked for: "fa3" on Hopper (sm_90), else "fa2".

    On an H200 the FA3 paged kernels took the 8k prefill in 4 chunks over the cached prefix from
    254.9 to 237.9 ms and a paged-only 8k pass from 245.7 to 229.7 ms (bench/results/GPU_NOTES.md,
    session 8); FA3 needs sm_90, the fa2 kernels run everywhere else.
    """
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


class PlanFence:
    """Holds a wrapper's next ``plan`` until the device has copied in its previous one.

    flashinfer's ``plan`` writes the schedule (per-CTA work lists and, for the FA3 kernels, each work
    item's kv length) into a pinned host buffer owned by the wrapper and enqueues one
    ``cudaMemcpyAsync`` from it on the current stream; nothing waits for that copy. When the host runs
    more than one forward ahead of the device (chunked prefill, pipelined decode), the next ``plan``
    overwrites the buffer before the earlier copy has run, and the earlier forward runs with the later
    batch's schedule: FA3 then reads kv positions past that batch's page table (an illegal memory
    access when the later batch is longer, silently wrong attention when it is shorter). vLLM
    (#40756) and mini-sglang (#103) hit the same race. An event recorded right after each plan marks
    the copy's place in the stream; the next plan of that wrapper waits for it, i.e. for the device
    to *start* the previous forward, not to finish it, so one forward of look-ahead remains.

    ``device``: the wrappers' CUDA device (flashinfer copies on that device's current stream; the
    event is recorded there, whichever device is current); ``make_event``: the event factory
    (``torch.cuda.Event``; tests pass a fake).
    """

    def __init__(self, device: torch.device | None = None, make_event=None):
        self.device = device
        self._make_event = make_event
        self._events: dict[int, tuple[object, object]] = {}  # id(wrapper) -> (wrapper, event)

    def plan(self, wrapper, *args, **kwargs) -> None:
        """``wrapper.plan(*args, **kwargs)``, after the device has consumed this wrapper's last plan."""
        held = self._events.get(id(wrapper))
        if held is None:
            ev = (self._make_event or torch.cuda.Event)()
            self._events[id(wrapper)] = (wrapper, ev)  # the wrapper is kept so its id stays unique
        else:
            ev = held[1]
            ev.synchronize()
        wrapper.plan(*args, **kwargs)
        ev.record(None if self.device is None else torch.cuda.current_stream(self.device))


def page_counts(seq_lens_cpu: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The host half of a page table: ``(indptr, last_page_len)``, both int32 on the CPU.

    ``seq_lens_cpu``: int64 [B] tokens per request (>= 0). indptr [B+1]: cumulative page counts;
    last_page_len [B]: tokens in each request's last page, 1..page_size, and 0 for a request of 0
    tokens, which has no page (flashinfer's kv_len = max(pages - 1, 0) * page_size + last_page_len).
    """
    seq = seq_lens_cpu.to(torch.int64)
    npages = (seq + page_size - 1) // page_size
    indptr = torch.zeros(len(seq) + 1, dtype=torch.int32)
    torch.cumsum(npages, 0, out=indptr[1:])
    last = torch.where(npages > 0, seq - (npages - 1) * page_size, 0).to(torch.int32)
    return indptr, last


def page_table(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens_cpu: torch.Tensor,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer page table of requests ``rows`` (int64 [B], on the pool's device).

    Returns ``(indptr, indices, last_page_len)``: indptr and last_page_len from :func:`page_counts`
    (int32, CPU), indices int32 [indptr[-1]] on ``req_to_token``'s device (page ids, computed there
    without a host sync). ``seq_lens_cpu``: int64 [B] tokens per request (>= 0).
    """
    indptr, last = page_counts(seq_lens_cpu, page_size)
    dev = req_to_token.device
    # page j of the flattened table belongs to request i = searchsorted(indptr, j, right) - 1
    j = torch.arange(int(indptr[-1]), device=dev)
    indptr_dev = indptr.to(dev, torch.int64, non_blocking=True)
    req = torch.searchsorted(indptr_dev, j, right=True) - 1
    pos = (j - indptr_dev[req]) * page_size
    idx = torch.div(req_to_token[rows.to(dev)[req], pos], page_size, rounding_mode="floor").to(torch.int32)
    return indptr, idx, last


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention through flashinfer (bf16/fp16 K/V on CUDA).

    Extra args: ``extend_mode`` ("ragged" | "paged"; default env HALFMOON_FLASHINFER_EXTEND, else
    "ragged"; see the module docstring), ``ragged_backend`` (kernels of the new-token part: "auto"
    picks FA3 on Hopper, "fa2"; default env HALFMOON_FLASHINFER_RAGGED, else "auto"),
    ``prefill_backend`` (kernels that read pages in extend: "fa2" | "fa3" | "auto"; default env
    HALFMOON_FLASHINFER_PREFILL, else :func:`default_prefill_backend`), ``decode_tensor_cores`` (flashinfer's
    tensor-core decode, the default; False, or env HALFMOON_FLASHINFER_DECODE_TENSOR_CORES=0, selects the
    CUDA-core decode kernel).
    Raises ValueError for a CPU pool or a float32 pool (flashinfer kernels take half types).
    """

    def __init__(self, kv_pool, req_to_token_pool, num_heads, num_kv_heads, head_dim, scale=None,
                 prefill_backend: str | None = None, decode_tensor_cores: bool | None = None,
                 extend_mode: str | None = None, ragged_backend: str | None = None):
        super().__init__(kv_pool, req_to_token_pool, num_heads, num_kv_heads, head_dim, scale)
        if kv_pool.device.type != "cuda":
            raise ValueError("attention_backend: flashinfer needs a CUDA KV pool")
        if kv_pool.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend: flashinfer needs bf16/fp16 K/V, got {kv_pool.dtype}")
        import flashinfer

        prefill_backend = (prefill_backend or os.environ.get("HALFMOON_FLASHINFER_PREFILL")
                           or default_prefill_backend(kv_pool.device))
        self.extend_mode = extend_mode or os.environ.get("HALFMOON_FLASHINFER_EXTEND", "ragged")
        if self.extend_mode not in EXTEND_MODES:
            raise ValueError(f"attention_backend: extend_mode must be one of {EXTEND_MODES}, got {self.extend_mode!r}")
        ragged_backend = ragged_backend or os.environ.get("HALFMOON_FLASHINFER_RAGGED", "auto")

        self._fi = flashinfer
        self.fence = PlanFence(kv_pool.device)
        dev = kv_pool.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.set_prefill_backend(prefill_backend)
        self.ragged_wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD",
                                                                              backend=ragged_backend)
        self._with_prefix = False
        # Tensor-core decode (flashinfer's prefill kernel with one query row per request) read the KV
        # at 3.1-4.1 TB/s on an H200 against 2.3-2.8 for the CUDA-core kernel (Llama-8B heads, bench/gpu.py
        # attn_micro), and covers every GQA group size (the CUDA-core one lacks 7: Qwen2.5-7B).
        if decode_tensor_cores is None:
            decode_tensor_cores = os.environ.get("HALFMOON_FLASHINFER_DECODE_TENSOR_CORES", "1") != "0"
        self.decode_tensor_cores = decode_tensor_cores
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=decode_tensor_cores)
        # per layer (K, V) [P, ps, kvh, head_dim]; page_major: strided views (page stride 2*layers*ps*kvh*hd)
        self.kv_cache = [(kv_pool.k_pages(i), kv_pool.v_pages(i)) for i in range(kv_pool.num_layers)]
        self._wrapper = None

    def set_prefill_backend(self, name: str) -> None:
        """Kernels that read pages in extend ("fa2" | "fa3" | "auto"): a new paged prefill wrapper,
        planned at the next :meth:`init_forward`."""
        self.prefill_backend = name
        self.prefill_wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=name)

    def make_decode_wrapper(self, batch_size: int, indices_buffer: torch.Tensor,
                            indptr_buffer: torch.Tensor | None = None):
        """A cuda-graph-mode decode wrapper for exactly ``batch_size`` requests; ``indices_buffer``
        (int32 [max pages in all], may be shared by wrappers that never run concurrently) holds the
        page ids and ``indptr_buffer`` (int32 [batch_size + 1], made here when None) the per-request
        page offsets that ``plan`` writes, so a graph captured over this wrapper stays valid across plans."""
        dev = self.kv_pool.device
        if indptr_buffer is None:
            indptr_buffer = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer,
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=dev))

    def plan_decode(self, wrapper, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor) -> None:
        """Plan ``wrapper`` for a decode batch from a :func:`page_table`."""
        self.fence.plan(wrapper, indptr, indices, last_page_len, self.num_heads, self.num_kv_heads,
                        self.head_dim, self.kv_pool.page_size, q_data_type=self.kv_pool.dtype, kv_data_type=self.kv_pool.dtype,
                        sm_scale=self.scale)

    def init_forward(self, batch: ForwardBatch) -> None:
        seq, ext = batch.host_lens()
        r2t, rows = self.req_to_token_pool.req_to_token, batch.req_pool_indices
        ps, dt = self.kv_pool.page_size, self.kv_pool.dtype
        if batch.mode is ForwardMode.DECODE:
            self.plan_decode(self.decode_wrapper, *page_table(r2t, rows, seq, ps))
            self._wrapper = self.decode_wrapper
            return
        qo_indptr = torch.zeros(len(ext) + 1, dtype=torch.int32)
        torch.cumsum(ext.to(torch.int32), 0, out=qo_indptr[1:])
        ragged = self.extend_mode == "ragged"
        if ragged:  # new tokens from q/k/v; the paged wrapper reads the cached prefix only, if any
            self.fence.plan(self.ragged_wrapper, qo_indptr, qo_indptr, self.num_heads, self.num_kv_heads,
                            self.head_dim, causal=True, sm_scale=self.scale, q_data_type=dt, kv_data_type=dt)
            self._wrapper = self.ragged_wrapper
            kv_lens = seq - ext
            self._with_prefix = bool((kv_lens > 0).any())
            if not self._with_prefix:
                return
        else:  # the paged wrapper reads the whole row, causal over the new tokens
            self._wrapper = self.prefill_wrapper
            kv_lens = seq
        indptr, indices, last = page_table(r2t, rows, kv_lens, ps)
        self.fence.plan(self.prefill_wrapper, qo_indptr, indptr, indices, last, self.num_heads,
                        self.num_kv_heads, self.head_dim, ps, causal=not ragged, sm_scale=self.scale,
                        q_data_type=dt, kv_data_type=dt)

    def set_wrapper(self, wrapper) -> None:
        """Use an already planned wrapper for the next forward (the cuda-graph runner's)."""
        self._wrapper = wrapper

    has_attend = True

    def forward(self, q, k, v, layer, batch):
        self.store_kv(layer, batch, k, v)
        return self.attend(q, k, v, layer, batch)

    def attend(self, q, k, v, layer, batch):
        # q, k, v may be row-strided views of the fused q/k/v projection: flashinfer's kernels (decode,
        # fa2 and fa3 prefill, ragged or paged) take each tensor's row and head strides, so the only
        # copy made is of a tensor whose last dim is not contiguous
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if self._wrapper is self.ragged_wrapper:
            dt = self.kv_pool.dtype
            k, v = k.to(dt), v.to(dt)
            if not self._with_prefix:
                o = self.ragged_wrapper.run(q, k, v)
            else:
                o, lse = self.ragged_wrapper.run(q, k, v, return_lse=True)
                o_pre, lse_pre = self.prefill_wrapper.run(q, self.kv_cache[layer], return_lse=True)
                self._fi.merge_state_in_place(o, lse, o_pre, lse_pre)
            return o.reshape(q.shape[0], self.num_heads * self.head_dim)
        o = self._wrapper.run(q, self.kv_cache[layer])
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)

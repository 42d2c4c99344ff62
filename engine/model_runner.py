"""ModelRunner: owns the model, the KV pool, the request-row pool, the page allocator and the
attention backend, and runs one :class:`~engine.forward_batch.ForwardBatch` at a time.

It knows nothing about requests or scheduling, so the co-located scheduler, the prefill service
(chunked extend batches, then reads its pages) and the decode service (writes a row ``[prefix
slots | delta slots]``, receives the delta's K/V by transfer, then runs decode steps) all drive it
the same way::

    runner = ModelRunner(EngineConfig(...))
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc_slots(0, len(ids), None)
    runner.req_to_token_pool.write(row, 0, slots)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids], slots)
    logits = runner.forward(batch)          # float32 [1, vocab]
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention import create_backend, resolve_backend_name
from engine.config import EngineConfig, served_context
from engine.forward_batch import ForwardBatch
from engine.gpu_env import GpuPaths, check_gpu_env
from engine.kvcache.kv_pool import KVPool, pages_for_budget
from engine.models.cpu_linear import CpuLinear
from engine.models.model_loader import load_model
from engine.models.llama import LlamaForCausalLM
from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.req_to_token_pool import ReqToTokenPool

if TYPE_CHECKING:
    from engine.distributed.group import FollowerSpec, TPGroup

log = logging.getLogger("halfmoon.engine.tp")


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: tuple[LlamaForCausalLM, Path | None] | None = None,
                 tp: "TPGroup | None" = None, follower: "FollowerSpec | None" = None):
        """Load the model (or reuse ``loaded = (model, hf_dir)`` from another runner, e.g. to build
        pools of another page size over the same weights) and allocate the pools.

        With ``config.tp_size > 1`` this runner is rank 0 of a tensor-parallel group: it starts the
        other ranks, and holds (as each of them) only its shard of the model and of the KV pool's kv
        heads (``engine.distributed``). ``tp`` is given by a follower rank only; ``follower`` picks
        the program ranks 1..N-1 run (default the engine's own follower).
        Raises InvalidRequestError(field="tp") when the model's heads cannot be split over ``tp_size``.
        """
        cpu_linear = CpuLinear.parse(config.cpu_linear)  # before anything is allocated
        # the GPU path's env switches too: valid, and used by this engine (engine.gpu_env)
        check_gpu_env(GpuPaths.of(torch.device(config.device), config.torch_dtype, config.fused_ops,
                                  config.cuda_graph, config.attention_backend))
        config.apply_threads()
        self.config = config
        self.dtype = config.torch_dtype
        # --- tensor parallelism (engine/distributed/): this rank's shard, or None for TP=1
        self.tp = tp
        self.tp_shard = None
        if config.tp_size > 1:
            from engine.distributed.runner_setup import start_tp

            self.tp, self.tp_shard, (self.model, self.model_path) = start_tp(config, tp, loaded, follower)
            self.device = self.tp.device
        else:
            self.device = torch.device(config.device)
            self.model, self.model_path = loaded or load_model(config.model, config.load_format, self.dtype,
                                                               self.device, config.seed)
        mc = self.model_config = self.model.config
        # this rank's heads (all of them without TP)
        self.num_heads = self.tp_shard.num_q_heads if self.tp_shard else mc.num_heads
        self.num_kv_heads = self.tp_shard.num_kv_heads if self.tp_shard else mc.num_kv_heads
        self.page_size = config.page_size
        self.max_context = served_context(config.max_context, mc.max_position_embeddings)
        num_pages = config.num_pages or pages_for_budget(
            config.kv_memory, config.page_size, mc.num_layers, self.num_kv_heads, mc.head_dim,
            self.dtype, self.device)
        if self.tp is not None:  # every rank's pool has the same pages (the budget is per rank)
            num_pages = self.tp.min_int(num_pages)
        backend_name = resolve_backend_name(config.attention_backend, self.device, self.dtype)
        # under TP every rank captures the same buckets; rank 0's choice per step travels in the batch
        use_graphs = config.cuda_graph and backend_name == "flashinfer"
        # CUDA graphs pad decode batches with entries that write into a scratch page no request owns:
        # the pool has one page more than the allocator hands out.
        self.scratch_page = num_pages if use_graphs else None
        self.kv_pool = KVPool(num_pages + int(use_graphs), config.page_size, mc.num_layers, self.num_kv_heads,
                              mc.head_dim, self.dtype, self.device, layout=config.kv_layout)
        self.allocator = PageAllocator(num_pages, config.page_size, self.device)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, self.max_context, self.device)
        self.backend = create_backend(backend_name, kv_pool=self.kv_pool,
                                      req_to_token_pool=self.req_to_token_pool, num_heads=self.num_heads,
                                      num_kv_heads=self.num_kv_heads, head_dim=mc.head_dim)
        # under TP the fused q/k/v and gate/up run on the rank's column slices; o/down keep their all-reduce
        if config.fused_ops and self.model._fused is None:
            from engine.fused_ops import enable_fused_ops, fused_ops_supported

            if fused_ops_supported(self.model):
                enable_fused_ops(self.model, self.max_context)
            else:
                from engine.torch_fused_ops import enable_torch_fused_ops

                enable_torch_fused_ops(self.model, cpu_linear)
        self.graph_runner = None
        if use_graphs:
            from engine.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self, config.cuda_graph_max_bs)
            if self.tp is not None:
                log.info("tensor parallel rank %d: cuda_graphs=on buckets=%s", self.tp.rank, self.graph_runner.buckets)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Run one batch; writes the new tokens' K/V at ``batch.out_cache_loc``.

        Returns float32 logits [B, vocab] of each request's last new token (or of the packed token
        rows in ``logit_index``, int64 [N]).
        """
        if logit_index is None and self.graph_runner is not None and self.graph_runner.can_run(batch):
            if self.tp is not None:  # every rank replays the bucket rank 0 picks (it travels in the batch)
                b = self.graph_runner.bucket_for(batch.batch_size)
                return self.tp.run(lambda: self.graph_runner.replay(batch, b), batch, None,
                                   self.req_to_token_pool.req_to_token, graph_bucket=b)
            return self.graph_runner.replay(batch)
        if self.tp is not None:  # rank 0: the followers run the same batch (raises TPRankDied)
            return self.tp.run(lambda: self.model(batch, self.backend, logit_index), batch, logit_index,
                               self.req_to_token_pool.req_to_token)
        return self.model(batch, self.backend, logit_index)

    def close(self) -> None:
        """Stop the tensor-parallel followers (nothing to do without TP). Idempotent."""
        if self.tp is not None:
            self.tp.close()

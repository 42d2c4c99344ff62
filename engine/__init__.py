"""halfmoon engine: what prefill and decode workers share. Imports no service.

Files (one concept each):
  config.py              ModelConfig (from HF config.json / engine/configs/<shape>.json), EngineConfig
  errors.py              InvalidRequestError(field), ResourceExhaustedError
  kvcache/               KV memory: page_allocator.py (PageAllocator: free list of pages; alloc_slots(cur_len,
                         new_len, last_slot)), req_to_token_pool.py (ReqToTokenPool: rows x max_context ->
                         slot, int64), kv_pool.py (KVPool: per-layer K/V views k_pages(l)/v_pages(l)
                         [num_pages, page_size, kv_heads, head_dim]; layout page_major (default: one region
                         [pages, layers, 2, ...], a page run = one byte range) or layer_major; buffers(),
                         page_bytes, page_stride_bytes), radix_cache.py (page-aligned radix tree, lock refs,
                         LRU eviction), page_hash.py (its chained page keys)
  forward_batch.py       ForwardBatch (EXTEND | DECODE, packed ragged tokens, out_cache_loc)
  attention/             AttentionBackend interface (base.py), torch backend (torch_backend.py)
  models/llama.py        Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2); models/rotary.py
  models/model_loader.py HF safetensors or dummy weights for a named shape
  model_runner.py        ModelRunner: model + pools + allocator + backend; forward(batch) -> logits
  distributed/           tensor parallelism (EngineConfig.tp_size): shard plan, parallel layers, rank
                         processes and their group (docs/architecture.md, Tensor parallelism)
  sampling_params.py     SamplingParams.validate(vocab_size, max_context, prompt_len)
  sampler.py             batch sampling (logit_bias, grammar masks, greedy, temperature, top-k/p, min-p,
                         seed, penalties, logprobs)
  grammar.py             structured outputs with xgrammar: GrammarSpec, GrammarCompiler (cached), GrammarState
  detokenizer.py         incremental detokenizer with stop strings (no split UTF-8 characters); the
                         router streams its text through it too
  scheduler/             scheduler.py: continuous-batching scheduler (co-located); request.py: Req
  engine.py              Engine: generate(...) and add_request/step streaming API, kv_stats()
  engine_args.py         command-line flags -> EngineConfig (shared by CLIs and workers)
  device.py              --device values (cpu | cuda | cuda:N), one-line error for an unusable CUDA device
  attention/flashinfer_backend.py, fused_ops.py, cuda_graph_runner.py   GPU path
  torch_fused_ops.py, models/cpu_linear.py, attention/torch_paged_backend.py   CPU path (fused
                         q/k/v + gate/up, oneDNN-packed weights, page-level decode gather)
  cpu_kernels.py         the C++ CPU kernels, built once per machine (make kernels):
                         attention/csrc/paged_decode.cpp (attention/cpu_paged_backend.py: decode
                         reading the KV pool in place), models/csrc/small_gemm.cpp (decode GEMMs)
  model_store.py         local model cache (names -> HF directories)

Seams the PD services use: ``ModelRunner`` (drive it directly with ``ForwardBatch.build`` and an
explicit ``out_cache_loc``), ``runner.req_to_token_pool`` / ``runner.allocator`` /
``runner.kv_pool.buffers()`` (register with the transfer engine) + ``pd_common.protocol.kv_layout``
(its KVLayout: layout, page_bytes, page_stride_bytes), ``sampler.sample``
with ``SamplingParams``.
"""

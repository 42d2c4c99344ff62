"""Fused CUDA kernels for the Llama-family forward (bf16/fp16 on CUDA): fewer, larger launches.

:func:`enable_fused_ops` rewires a loaded :class:`~engine.models.llama.LlamaForCausalLM` in place:

* q/k/v projections run as one GEMM, gate/up as one: the model's own ``qkv_proj`` / ``gate_up_proj``
  when it has them, else a fused weight whose shards the original ``*.weight`` parameters become
  views of (same names, no extra memory);
* RMSNorm -> ``flashinfer.norm.rmsnorm`` (one kernel instead of seven element-wise ones);
* RoPE -> ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace`` on the q/k views of the fused
  projection output, with a float32 cos/sin table built from the model's own ``inv_freq``
  (llama3 / linear scaling included), so frequencies equal the torch path's;
* with an attention backend that has ``attend`` (flashinfer), RoPE and the new K/V's store in the
  pool -> one Triton kernel per layer (:func:`engine.kvcache.rope_kv_store.rope_kv_store`; three
  kernels before); env ``HALFMOON_FUSED_ROPE_STORE=0``, or no Triton, keeps flashinfer's RoPE and
  ``KVPool.write``;
* SiLU(gate) * up -> ``flashinfer.activation.silu_and_mul``;
* the o and down projections of a batch of at most 8 rows (decode at small batch) ->
  ``flashinfer.gemm.tinygemm_bf16`` on sm90+ (bf16): see :mod:`engine.small_m_gemm`;
* optionally (env ``HALFMOON_TUNED_GEMM``, off by default; ``HALFMOON_TUNED_GEMM_ROWS``), the
  projections captured in the decode graphs -> ``flashinfer.mm_bf16`` with the autotuner's
  per-shape choice: see :mod:`engine.tuned_gemm`;
* each residual add and the RMSNorm after it -> ``flashinfer.norm.fused_add_rmsnorm`` (one kernel,
  in place), the layers passing ``(hidden, residual)`` to each other as in sglang's Llama.

Under tensor parallelism (``engine.distributed``) the same rewiring runs on a rank's shard: the fused
q/k/v and gate/up weights concatenate its column slices (``attn.h`` / ``attn.kvh`` are its heads)
and o_proj / down_proj stay the row-parallel modules with their all-reduce (not run on a GPU yet).

Numerics: the fused kernels compute in float32 and round once, the torch path (HF's) rounds to the
model dtype between steps; both stay within bf16 tolerance of each other (tests/unit/test_gpu_*.py).
Design after sglang's ``LlamaForCausalLM`` (merged qkv / gate_up projections, flashinfer kernels).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from engine.kvcache.rope_kv_store import rope_kv_store
from engine.small_m_gemm import small_m_gemm_mode, small_m_projections, takes_small_m_gemm, tinygemm_available
from engine.tuned_gemm import TunedGemm


def fused_ops_supported(model) -> bool:
    """True for a model on CUDA in bf16/fp16 with flashinfer importable."""
    p = next(model.parameters())
    if p.device.type != "cuda" or p.dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FusedOps:
    """What the model's modules call when fused ops are enabled (see the module docstring)."""

    def __init__(self, model, max_positions: int):
        import flashinfer

        self.fi = flashinfer
        cfg = model.config
        self.head_dim = cfg.head_dim
        inv = model.model.rotary.inv_freq.float()
        dev = inv.device
        t = torch.arange(max_positions, dtype=torch.float32, device=dev)
        freqs = torch.outer(t, inv)  # [max_positions, head_dim // 2]
        self.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), -1).contiguous()  # float32 [P, head_dim]
        # RoPE + K/V store in one kernel (see the module docstring); read once, at enable time
        self.rope_store = (os.environ.get("HALFMOON_FUSED_ROPE_STORE", "1") != "0"
                           and importlib.util.find_spec("triton") is not None)
        mode = small_m_gemm_mode(tinygemm_available(dev, flashinfer), next(model.parameters()).dtype)
        self.small_m = None if mode == "cublas" else flashinfer.gemm.tinygemm_bf16
        self.small_m_pdl = mode == "tinygemm"
        self.small_m_on = small_m_projections()
        self.small_m_calls = 0  # projections issued on tinygemm (eager calls + graph captures)
        # None unless HALFMOON_TUNED_GEMM asks for it; active only in the graph runner's warm-ups (tuning) and captures
        self.tuned = TunedGemm.from_env(flashinfer, dev, next(model.parameters()).dtype)

    def linear(self, proj: str, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for x [T, K], weight [N, K] -> [T, N] in x's dtype; small
        batches on tinygemm when enabled for ``proj`` (one of :data:`PROJECTIONS`), else inside a
        tuned scope on the tuned GEMM (see the module docstring)."""
        if self.small_m is not None and proj in self.small_m_on and takes_small_m_gemm(x, weight):
            out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
            self.small_m(x, weight, out, bias, self.small_m_pdl)
            self.small_m_calls += 1
            return out
        tuned = getattr(self, "tuned", None)
        if tuned is not None and tuned.takes(proj, x, weight, bias):
            return tuned(x, weight)
        return F.linear(x, weight, bias)

    def project(self, proj: str, module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` for projection ``proj``: a plain ``nn.Linear`` goes through :meth:`linear`;
        any other module (a tensor-parallel one with its all-reduce) is called as it is."""
        if type(module) is torch.nn.Linear:
            return self.linear(proj, x, module.weight, module.bias)
        return module(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        return self.fi.norm.rmsnorm(x.reshape(-1, shape[-1]).contiguous(), weight, eps).view(shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.fi.activation.silu_and_mul(gate_up)

    def rope_(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """In place on q [T, H*D] and k [T, KVH*D] (row-strided views are fine)."""
        self.fi.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, self.head_dim,
                                                           self.cos_sin_cache, is_neox=True)

    def attention(self, attn, x, batch, backend) -> torch.Tensor:
        """Attention block of one layer (``attn`` an engine.models.llama.Attention): [T, hidden] ->
        [T, H*D], before ``o_proj``."""
        T = x.shape[0]
        H, KVH, D = attn.h, attn.kvh, attn.d
        qkv = attn.qkv_proj(x) if attn.qkv_weight is None else self.linear("qkv", x, attn.qkv_weight, attn.qkv_bias)
        q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        if attn.q_norm is not None:  # Qwen3: per-head norm before RoPE (new tensors)
            q = self.rms_norm(q.reshape(T, H, D), attn.q_norm.weight, attn.q_norm.eps).view(T, H * D)
            k = self.rms_norm(k.reshape(T, KVH, D), attn.k_norm.weight, attn.k_norm.eps).view(T, KVH * D)
        if self.rope_store and backend.has_attend:
            pool = backend.kv_pool
            rope_kv_store(q, k, v, batch.positions, self.cos_sin_cache, batch.out_cache_loc,
                          pool.k_pages(attn.layer), pool.v_pages(attn.layer), pdl=backend.pdl)
            return backend.attend(q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D), attn.layer, batch)
        self.rope_(batch.positions, q, k)
        return backend.forward(q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D), attn.layer, batch)

    def decoder_layers(self, model, x: torch.Tensor, batch, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer of ``model`` (an engine.models.llama.LlamaModel) over the embeddings
        ``x`` [T, hidden] -> ``(h, residual)``, both [T, hidden], whose sum is the last layer's
        output. ``x`` becomes the residual stream and is updated in place."""
        fused_add_rmsnorm = self.fi.norm.fused_add_rmsnorm  # residual += h; h = rmsnorm(residual)
        residual, h = x, None
        for layer in model.layers:
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            if h is None:
                h = self.rms_norm(residual, n1.weight, n1.eps)
            else:
                fused_add_rmsnorm(h, residual, n1.weight, n1.eps)
            h = layer.self_attn(h, None, None, batch, backend)
            fused_add_rmsnorm(h, residual, n2.weight, n2.eps)
            h = layer.mlp(h)
        return h, residual

    def mlp(self, mlp, x) -> torch.Tensor:
        gate_up = mlp.gate_up_proj(x) if mlp.gate_up_weight is None else self.linear("gate_up", x, mlp.gate_up_weight)
        return self.project("down", mlp.down_proj, self.silu_mul(gate_up))


def _fuse(linears) -> torch.Tensor:
    """Concatenate the weights of ``linears`` along dim 0 and make each one's weight a view."""
    fused = torch.cat([lin.weight.data for lin in linears], 0)
    off = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[off:off + n]
        off += n
    return fused


def enable_fused_ops(model, max_positions: int) -> FusedOps:
    """Rewire ``model`` (in place) to the fused path; returns the :class:`FusedOps` it uses.

    ``max_positions``: size of the RoPE table (the runner's max_context).
    Raises ValueError when :func:`fused_ops_supported` is False.
    """
    if not fused_ops_supported(model):
        raise ValueError("fused ops need a bf16/fp16 model on CUDA and flashinfer")
    ops = FusedOps(model, max_positions)
    with torch.no_grad():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_weight = a.qkv_bias = m.gate_up_weight = None  # None: the model's own fused Linear
            if not hasattr(a, "qkv_proj"):
                a.qkv_weight = _fuse([a.q_proj, a.k_proj, a.v_proj])
                a.qkv_bias = (torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
                              if a.q_proj.bias is not None else None)
            if not hasattr(m, "gate_up_proj"):
                m.gate_up_weight = _fuse([m.gate_proj, m.up_proj])
            a._fused = m._fused = ops
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm._fused = ops
        model.model.norm._fused = ops
        model._fused = ops
    torch.cuda.empty_cache()
    return ops

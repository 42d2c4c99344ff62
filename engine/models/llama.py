"""Llama-family decoder over a paged KV pool (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

One class covers the family; the differences are config switches: q/k/v bias (Qwen2), per-head
q/k RMSNorm before RoPE (Qwen3), llama3 RoPE scaling, tied embeddings (SmolLM2, small Qwen).
Parameter names equal the Hugging Face checkpoint names, so a safetensors state dict loads as is.

Inputs are packed ragged tokens (``ForwardBatch``); attention goes through an
:class:`~engine.attention.base.AttentionBackend`, which writes K/V into the pool.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.models.rotary import Rotary, apply_rotary


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 as HF's LlamaRMSNorm."""

    _fused = None  # engine.fused_ops.FusedOps when enabled (CUDA bf16/fp16), else the torch path

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._fused.rms_norm(x, self.weight, self.eps)
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


class Attention(nn.Module):
    _fused = None  # see RMSNorm._fused; then qkv_weight/qkv_bias hold the fused projection
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.d, bias=b)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, batch: ForwardBatch, backend: AttentionBackend):
        if self._fused is not None:
            return self._fused.project("o", self.o_proj, self._fused.attention(self, x, batch, backend))
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.h, self.d)
        k = self.k_proj(x).view(T, self.kvh, self.d)
        v = self.v_proj(x).view(T, self.kvh, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(backend.forward(q, k, v, self.layer, batch))


class MLP(nn.Module):
    _fused = None  # see RMSNorm._fused; then gate_up_weight holds the fused projection
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        if self._fused is not None:
            return self._fused.mlp(self, x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    _fused = None  # engine.fused_ops.enable_fused_ops sets it (then RoPE runs inside attention)
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch, backend: AttentionBackend,
                logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Returns float32 logits [len(logit_index), vocab] for the packed token rows in
        ``logit_index`` (default: each request's last new token, i.e. ``cumsum(extend_lens) - 1``)."""
        m = self.model
        x = m.embed_tokens(batch.input_ids)
        cos, sin = m.rotary.cos_sin(batch.positions, x.dtype) if self._fused is None else (None, None)
        backend.init_forward(batch)
        if logit_index is None:
            logit_index = torch.cumsum(batch.extend_lens, 0) - 1
        logit_index = logit_index.to(x.device)
        if self._fused is not None:  # residual adds fused into the norms; x = h + residual at the end
            h, residual = self._fused.decoder_layers(m, x, batch, backend)
            x = m.norm(h[logit_index] + residual[logit_index])
        else:
            for layer in m.layers:
                x = layer(x, cos, sin, batch, backend)
            x = m.norm(x[logit_index])
        return self.lm_head(x).float()

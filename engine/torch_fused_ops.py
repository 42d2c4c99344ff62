"""Fused projections for the Llama-family forward on any device without flashinfer (CPU, fp32).

:func:`enable_torch_fused_ops` rewires a loaded :class:`~engine.models.llama.LlamaForCausalLM` in
place, the torch counterpart of :mod:`engine.fused_ops`:

* q/k/v run as one GEMM and gate/up as one (121 GEMMs per step instead of 211 for 30 layers): the
  fused weights are new tensors whose row blocks the original ``*_proj.weight`` parameters become
  views of (same names, no extra memory);
* on a float32 CPU model (or a bfloat16 one where oneDNN has native bf16 GEMMs) with
  ``cpu_linear=packed``, every GEMM (the fused ones, ``o_proj``, ``down_proj``, ``lm_head``) runs on
  weights packed once (:mod:`engine.models.cpu_linear`);
* cos/sin of RoPE are computed once per forward and shared by all layers;
* on a tensor-parallel shard (``engine.distributed``) the fused q/k/v and gate/up GEMMs run on the
  rank's column slices (its heads, its intermediate columns) and o/down keep their all-reduce.

Norms, RoPE, SiLU·mul and the residual adds compute what HF's LlamaDecoderLayer computes, in the
same order, so only the GEMM summation order can differ from the unfused forward. Where the
``decode_glue`` kernel is built (``make kernels``) and the model is a plain Llama (no q/k norm),
each of them is one C++ call on the residual stream in place (``models/csrc/decode_glue.cpp``, the
same bits as the torch ops) and the layer loop calls the projections' ``forward`` directly: with a
few rows per step the ~40 Python ops and module calls per layer cost more than the norms' arithmetic
(on SmolLM2-135M, 30 layers, about a quarter of a batch-1 step on two cores).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.cpu_kernels import DECODE_GLUE
from engine.distributed.parallel_linear import PackedRowParallelLinear, RowParallelLinear
from engine.models.cpu_linear import (CpuLinear, fused_linear, pack_linear, packed_linear_supported,
                                      release_packed_sources, trim_heap)
from engine.models.rotary import apply_rotary

log = logging.getLogger("halfmoon.engine.models")


class TorchFusedOps:
    """What the model's modules call when torch fused ops are enabled (module docstring).

    Attributes:
        qkv, gate_up: per layer, the fused projection module (``nn.Linear`` or ``PackedLinear``).
        cpu_linear: the :class:`CpuLinear` the GEMMs run with.
        glue: the loaded ``decode_glue`` kernel module the layer loop runs its element-wise steps
            with, or None (torch ops; a benchmark may set it to None to compare).
    """

    def __init__(self, qkv: list, gate_up: list, cpu_linear: CpuLinear, glue=None):
        self.qkv, self.gate_up, self.cpu_linear, self.glue = qkv, gate_up, cpu_linear, glue
        self._cos_sin = (None, None)

    def attention(self, attn, x, batch, backend) -> torch.Tensor:
        """Attention block of one layer: [T, hidden] -> [T, H*D], before ``o_proj``."""
        T = x.shape[0]
        H, KVH, D = attn.h, attn.kvh, attn.d
        q, k, v = self.qkv[attn.layer](x).split([H * D, KVH * D, KVH * D], dim=-1)
        q, k, v = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self._cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return backend.forward(q, k, v, attn.layer, batch)

    def project(self, proj: str, module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` for projection ``proj`` (the fused GPU ops' seam; here o_proj / down_proj
        carry their packed kernels in the modules themselves)."""
        return module(x)

    def mlp(self, mlp, x) -> torch.Tensor:
        gate, up = self.gate_up[mlp.layer](x).chunk(2, dim=-1)
        return mlp.down_proj(F.silu(gate) * up)

    def decoder_layers(self, model, x: torch.Tensor, batch, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer over the embeddings ``x`` [T, hidden] -> ``(h, residual)`` whose sum is
        the last layer's output (h = the last MLP output, residual = its input stream)."""
        self._cos_sin = model.rotary.cos_sin(batch.positions, x.dtype)
        if self.glue is not None:
            try:
                return self._glued_layers(model, x.contiguous(), batch, backend)
            finally:
                self._cos_sin = (None, None)
        h = None
        for layer in model.layers:
            if h is not None:
                x = x + h
            x = x + layer.self_attn(layer.input_layernorm(x), None, None, batch, backend)
            h = layer.mlp(layer.post_attention_layernorm(x))
        self._cos_sin = (None, None)
        return h, x

    def _glued_layers(self, model, x: torch.Tensor, batch, backend) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decoder_layers` with the ``decode_glue`` kernel: ``x`` [T, hidden] (contiguous)
        is the residual stream, updated in place by each norm's residual add."""
        g = self.glue
        cos, sin = self._cos_sin
        T, h = x.shape[0], None
        for layer in model.layers:
            a, m, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            H, KVH, D = a.h, a.kvh, a.d
            qkv = self.qkv[a.layer].forward(g.add_rms_norm(x, h, n1.weight, n1.eps))
            g.rope_(qkv, cos, sin, H + KVH, D)  # q's and k's heads, in place
            q = qkv[:, :H * D].view(T, H, D)
            k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
            v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
            o = a.o_proj.forward(backend.forward(q, k, v, a.layer, batch))
            gate_up = self.gate_up[m.layer].forward(g.add_rms_norm(x, o.contiguous(), n2.weight, n2.eps))
            h = m.down_proj.forward(g.silu_mul(gate_up)).contiguous()
        return h, x


def glue_kernel(model):
    """The ``decode_glue`` module when it can run ``model``'s layers (a CPU model in float32 or
    bfloat16 without per-head q/k norms, the kernel built), else None."""
    p = model.model.embed_tokens.weight
    if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.bfloat16):
        return None
    if any(layer.self_attn.q_norm is not None for layer in model.model.layers):
        return None
    return DECODE_GLUE.load_or_say_why(log, "decode glue kernel not used, norms, RoPE and SiLU·mul run as torch ops")


def _pack_out(lin, impl: CpuLinear):
    """o_proj / down_proj as ``impl`` runs them; under tensor parallelism they are row-parallel and
    keep their all-reduce (only the local GEMM is packed)."""
    if isinstance(lin, RowParallelLinear):
        packed = impl.packs and packed_linear_supported(lin.weight)
        return PackedRowParallelLinear(lin, small_rows=impl.small_rows) if packed else lin
    return pack_linear(lin, impl)


def enable_torch_fused_ops(model, cpu_linear: str | CpuLinear = CpuLinear.PACKED) -> TorchFusedOps:
    """Rewire ``model`` (in place) to fused q/k/v and gate/up GEMMs, packed on a float32 (or natively
    bf16) CPU model when ``cpu_linear`` is ``packed``; returns the :class:`TorchFusedOps` it uses.

    Raises ValueError naming ``cpu_linear`` for an unknown value, or when the model already runs
    fused ops.
    """
    impl = CpuLinear.parse(cpu_linear)
    if model._fused is not None:
        raise ValueError("fused ops are already enabled on this model")
    qkv, gate_up, freed = [], [], 0
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        qkv.append(pack_linear(fused_linear([a.q_proj, a.k_proj, a.v_proj]), impl))
        gate_up.append(pack_linear(fused_linear([m.gate_proj, m.up_proj]), impl))
        a.o_proj = _pack_out(a.o_proj, impl)
        m.down_proj = _pack_out(m.down_proj, impl)
        m.layer = i  # TorchFusedOps.mlp finds the layer's gate_up by it
        if impl.packs:  # layer by layer: loading peaks at one layer's extra copies
            freed += release_packed_sources(model, [qkv[-1], gate_up[-1], a.o_proj, m.down_proj],
                                            [a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj])
    ops = TorchFusedOps(qkv, gate_up, impl, glue=glue_kernel(model))
    for layer in model.model.layers:
        layer.self_attn._fused = layer.mlp._fused = ops
    model.lm_head = pack_linear(model.lm_head, impl)
    model._fused = ops
    if impl.packs:
        freed += release_packed_sources(model, [model.lm_head], [])
        trim_heap()
        log.info("packed linear weights (%s): released %.0f MB of row-major copies", impl.value, freed / 2**20)
    return ops

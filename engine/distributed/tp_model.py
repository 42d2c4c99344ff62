"""A Llama-family model (``engine.models.llama``) built as one tensor-parallel rank's shard.

The model is the ordinary :class:`~engine.models.llama.LlamaForCausalLM` constructed with the
rank's local sizes (``TPShard.local_config``: its q/kv heads, MLP columns, vocabulary rows), so its
forward code is unchanged; then o_proj and down_proj become :class:`RowParallelLinear` (one
all-reduce each), q/k/v and gate/up :class:`ColumnParallelLinear`, the embedding
:class:`VocabParallelEmbedding` and the head :class:`ParallelLMHead` (tied to the embedding's shard
when the checkpoint ties them). ``model.config`` stays the full model's config.

Weights are read slice by slice (safetensors ``get_slice``), so a rank never holds more than its
shard of a checkpoint tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.distributed.parallel_linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                                VocabParallelEmbedding)
from engine.distributed.shard import TPShard
from engine.models.llama import LlamaForCausalLM
from engine.models.model_loader import build_model, checkpoint_slices, init_dummy_weights, resolve_model_config
from engine.models.rotary import inv_freq


def _column(old: torch.nn.Linear) -> ColumnParallelLinear:
    return ColumnParallelLinear(old.in_features, old.out_features, bias=old.bias is not None)


def build_tp_model(cfg: ModelConfig, shard: TPShard, group: dist.ProcessGroup, dtype: torch.dtype,
                   device: torch.device) -> LlamaForCausalLM:
    """The rank's modules of ``cfg`` on ``device``, weights uninitialised."""
    local = shard.local_config(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(local)
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.q_proj, a.k_proj, a.v_proj = _column(a.q_proj), _column(a.k_proj), _column(a.v_proj)
            a.o_proj = RowParallelLinear(a.o_proj.in_features, cfg.hidden_size, group)
            m.gate_proj, m.up_proj = _column(m.gate_proj), _column(m.up_proj)
            m.down_proj = RowParallelLinear(m.down_proj.in_features, cfg.hidden_size, group)
        model.model.embed_tokens = VocabParallelEmbedding(shard.vocab_per_rank, cfg.hidden_size,
                                                          shard.vocab[0], group)
        model.lm_head = ParallelLMHead(shard.vocab_per_rank, cfg.hidden_size, cfg.vocab_size, group)
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary.inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.config = cfg
    return model.eval().requires_grad_(False)


def param_slices(cfg: ModelConfig, shard: TPShard) -> dict[str, tuple[int, int, int]]:
    """HF parameter name -> (dim, start, stop) of the checkpoint tensor this rank holds; parameters
    not named are replicated whole. Vocabulary stops may pass ``vocab_size`` (zero padding)."""
    d = cfg.head_dim
    q = (shard.q_heads[0] * d, shard.q_heads[1] * d)
    kv = (shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    out = {"model.embed_tokens.weight": (0, *shard.vocab), "lm_head.weight": (0, *shard.vocab)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name, dim, rng in (("self_attn.q_proj", 0, q), ("self_attn.k_proj", 0, kv),
                               ("self_attn.v_proj", 0, kv), ("self_attn.o_proj", 1, q),
                               ("mlp.gate_proj", 0, shard.intermediate), ("mlp.up_proj", 0, shard.intermediate),
                               ("mlp.down_proj", 1, shard.intermediate)):
            out[p + name + ".weight"] = (dim, *rng)
            if dim == 0:
                out[p + name + ".bias"] = (0, *rng)
    return out


def _copy_slice(param: torch.Tensor, source, spec: tuple[int, int, int] | None, full_shape) -> None:
    if spec is None:
        param.copy_(source[:] if not isinstance(source, torch.Tensor) else source)
        return
    dim, start, stop = spec
    stop_in = min(stop, full_shape[dim])
    idx = (slice(start, stop_in),) if dim == 0 else (slice(None), slice(start, stop_in))
    part = source[idx]
    n = stop_in - start
    target = param.narrow(dim, 0, n)
    target.copy_(part)
    if n < stop - start:  # vocabulary padding rows
        param.narrow(dim, n, stop - start - n).zero_()


def load_tp_model(model_name: str, load_format: str, shard: TPShard, group: dist.ProcessGroup,
                  dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple[LlamaForCausalLM, Path | None]:
    """Build and fill rank ``shard.rank``'s model; returns (model, HF dir or None for dummy weights).

    Dummy weights are the TP=1 model's (same seed), built whole on the host and sliced, so TP=N
    and TP=1 compute the same function. Raises as ``engine.models.model_loader.load_model``.
    """
    cfg, path = resolve_model_config(model_name, load_format)
    model = build_tp_model(cfg, shard, group, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    slices = param_slices(cfg, shard)
    tied = cfg.tie_word_embeddings
    seen = set()
    with torch.no_grad():
        if path is None:
            full = build_model(cfg, dtype, torch.device("cpu"))
            init_dummy_weights(full, seed)
            for name, t in full.named_parameters(remove_duplicate=False):
                if name in params:
                    _copy_slice(params[name], t, slices.get(name), t.shape)
                    seen.add(name)
            del full
        else:
            for name, sl in checkpoint_slices(path, params):
                _copy_slice(params[name], sl, slices.get(name), sl.get_shape())
                seen.add(name)
    missing = set(params) - seen
    if tied:
        missing.discard("lm_head.weight")
    if missing:
        raise RuntimeError(f"checkpoint {path} lacks {sorted(missing)[:8]}")
    return model, path

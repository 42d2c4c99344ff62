"""What a :class:`~engine.model_runner.ModelRunner` of a tensor-parallel engine does first: form
the group (rank 0 starts the followers) and load this rank's shard of the model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.distributed.group import FollowerSpec, TPGroup
from engine.distributed.shard import TPShard, plan_shard
from engine.distributed.tp_model import load_tp_model
from engine.models.llama import LlamaForCausalLM
from engine.models.model_loader import resolve_model_config


def start_tp(config: EngineConfig, group: TPGroup | None, loaded, spec: FollowerSpec | None = None
             ) -> tuple[TPGroup, TPShard, tuple[LlamaForCausalLM, Path | None]]:
    """(group, this rank's shard, (model, HF dir)). ``group`` None: this is rank 0, start the others
    (running ``spec``'s program; default the engine's follower).

    Raises InvalidRequestError(field="tp") before any process starts when the model's heads cannot
    be split, when ``loaded`` weights are passed (a shard is loaded per rank, never shared), or
    when this process already runs a TP engine (one ``torch.distributed`` group per process);
    TPRankDied / RuntimeError when the group does not form within ``config.tp_timeout_s``.
    """
    if loaded is not None:
        raise InvalidRequestError("tp", "a tensor-parallel engine loads its own shards; it cannot reuse loaded weights")
    cfg, _ = resolve_model_config(config.model, config.load_format)
    plan_shard(cfg, 0, config.tp_size)  # raises InvalidRequestError for a split that cannot work
    dev = torch.device(config.device)
    if dev.type == "cuda" and (dev.index or 0) + config.tp_size > torch.cuda.device_count():
        raise InvalidRequestError("tp", f"{config.tp_size} ranks from {dev} need GPUs up to "
                                        f"cuda:{(dev.index or 0) + config.tp_size - 1}; "
                                        f"this host has {torch.cuda.device_count()}")
    if group is None and dist.is_initialized():
        raise InvalidRequestError("tp", "this process already runs a tensor-parallel engine (its "
                                        "torch.distributed group); close() it before starting another")
    if group is None:
        group = TPGroup.launch(json.loads(config.to_json()), config.tp_size, config.device, config.tp_timeout_s,
                               spec=spec or FollowerSpec())
    shard = plan_shard(cfg, group.rank, group.size)
    try:
        model = load_tp_model(config.model, config.load_format, shard, group.group, config.torch_dtype,
                              group.device, config.seed)
        group.barrier("loaded")  # every rank loaded: collectives from here on run under tp_timeout_s
    except BaseException:
        group.kill()
        raise
    return group, shard, model

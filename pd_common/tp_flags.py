"""Start-up checks of a worker's ``--tp`` against its other flags and its model: one error line
naming the flag, before any rank process starts or any weight loads."""

from __future__ import annotations


def check_tp_flags(args) -> str | None:
    """Why ``--tp`` cannot run with the other flags (a start-up error), or None."""
    if args.tp > 1 and args.kv_layout != "page_major":
        return "--tp > 1 needs --kv-layout page_major (per-rank KV writes address page_major shards)"
    if args.tp > 1:  # heads that cannot split: one line here, not a traceback from the model load
        from engine.distributed.shard import check_tp_size
        from engine.errors import InvalidRequestError
        from engine.models.model_loader import resolve_model_config

        try:
            cfg, _ = resolve_model_config(args.model, args.load_format)
        except Exception:  # an unknown model: the load reports it
            return None
        try:
            check_tp_size(cfg, args.tp)
        except InvalidRequestError as e:
            return f"--tp {args.tp}: {str(e).removeprefix('tp: ')}"
    return None

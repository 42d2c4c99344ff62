"""What both halves of a PD pair share, so neither service imports the other's internals.

- ``protocol.py``: request validation, proto <-> engine conversions, the published KV layout
  (the wire-level rules of the PD protocol); ``head_checksums.py``: the notice's KV checksums, one
  per (page, kv head), and ``rank_checksums.py``: those sums over every tensor-parallel rank.
- ``worker_runtime.py``: worker start-up/shut-down (model + pool, transfer engine, gRPC server with
  health and reflection, /metrics, registry record) and the flags both worker commands take.

Exported for tools (bench/tp_transfer.py): the per-rank head-block plan of ``head_slices.py`` and
the rank region it plans over, one rank's writes (``staged_writes.py``) and D's unblock
(``head_blocks.py``).
"""

_SLICES = ["BlockWrite", "PageShape", "RankRegion", "RankWrite", "block_descriptors", "block_write", "check_pages",
           "head_cuts", "plan_rank_writes"]
_BLOCKS = ["rank_blocks", "unblock_pages"]
_STAGED = ["DEFAULT_STAGING_MB", "RankWrites", "Target"]
__all__ = _SLICES + _BLOCKS + _STAGED


def __getattr__(name: str):
    # lazy (PEP 562): importing the package must not load the transfer engine (the router imports
    # pd_common.protocol and never needs UCX)
    if name in _SLICES:
        from pd_common import head_slices as module
    elif name in _BLOCKS:
        from pd_common import head_blocks as module
    elif name in _STAGED:
        from pd_common import staged_writes as module
    else:
        raise AttributeError(f"module 'pd_common' has no attribute {name!r}")
    return getattr(module, name)

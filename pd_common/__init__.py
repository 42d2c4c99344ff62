"""What both halves of a PD pair share, so neither service imports the other's internals.

- ``protocol.py``: request validation, proto <-> engine conversions, the published KV layout
  (the wire-level rules of the PD protocol); ``head_checksums.py``: the notice's KV checksums, one
  per (page, kv head), and ``rank_checksums.py``: those sums over every tensor-parallel rank.
- ``worker_runtime.py``: worker start-up/shut-down (model + pool, transfer engine, gRPC server with
  health and reflection, /metrics, registry record) and the flags both worker commands take.

Exported for tools (bench/tp_transfer.py): the per-rank head-slice plan of ``head_slices.py`` and
the rank region it plans over.
"""

__all__ = ["PageShape", "RankRegion", "RankWrite", "plan_rank_writes", "slice_descriptors"]


def __getattr__(name: str):
    # lazy (PEP 562): importing the package must not load the transfer engine (the router imports
    # pd_common.protocol and never needs UCX)
    if name in __all__:
        from pd_common import head_slices

        return getattr(head_slices, name)
    raise AttributeError(f"module 'pd_common' has no attribute {name!r}")

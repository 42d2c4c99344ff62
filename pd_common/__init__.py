"""What both halves of a PD pair share, so neither service imports the other's internals.

- ``protocol.py``: request validation, proto <-> engine conversions, the published KV layout,
  per-page checksums (the wire-level rules of the PD protocol).
- ``worker_runtime.py``: worker start-up/shut-down (model + pool, transfer engine, gRPC server with
  health and reflection, /metrics, registry record) and the flags both worker commands take.

Exported for tools (bench/tp_transfer.py): the per-rank head-slice plan of ``head_slices.py``.
"""

from pd_common.head_slices import PageShape, RankWrite, plan_rank_writes, slice_descriptors

__all__ = ["PageShape", "RankWrite", "plan_rank_writes", "slice_descriptors"]

"""halfmoon's KV transfer: a Mooncake-style transfer engine over UCX and the segment registry.

The engine's public API (transfer_svc.engine explains the model):

    from transfer_svc import TransferEngine, Op, State
"""

from transfer_svc.engine import TransferEngine
from transfer_svc.types import (BatchStatus, BoundsError, DescriptorError, Notify, Op, Region,
                                Segment, SegmentClosed, State, TransferError)
from transfer_svc.ucp import UCXError

__all__ = ["TransferEngine", "Op", "State", "BatchStatus", "Notify", "Region", "Segment",
           "TransferError", "SegmentClosed", "DescriptorError", "BoundsError", "UCXError"]

"""Received notifies: small messages peers send with send_notify, as UCX eager active messages.

Wire format: active-message id NOTIFY_AM_ID, header = the sender's segment name (UTF-8), data =
the payload. The progress thread appends; any caller thread drains.
"""

from __future__ import annotations

import collections
import threading

from transfer_svc.types import Notify

NOTIFY_AM_ID = 17


class NotifyInbox:
    """Notifies in arrival order, with an event set while any are waiting."""

    def __init__(self) -> None:
        self._notifies: collections.deque[Notify] = collections.deque()
        self._event = threading.Event()

    def deliver(self, header: bytes, payload: bytes) -> None:
        """Active-message handler (progress thread): header is the sender's name."""
        self._notifies.append(Notify(header.decode(errors="replace"), payload))
        self._event.set()

    def poll(self) -> list[Notify]:
        """Notifies received since the last call, in arrival order (never blocks)."""
        out = []
        while self._notifies:
            out.append(self._notifies.popleft())
        self._event.clear()
        if self._notifies:  # one arrived between the drain and clear(): keep the event set
            self._event.set()
        return out

    def wait(self, timeout_s: float) -> list[Notify]:
        """poll(), first waiting up to timeout_s seconds for at least one."""
        self._event.wait(timeout_s)
        return self.poll()

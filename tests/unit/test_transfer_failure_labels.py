"""halfmoon_transfer_failures_total's `reason` label (transfer_svc.inflight.failure_label).

A peer killed mid-batch reaches the sender as whichever error UCX saw first: a connection reset,
an I/O error, an endpoint timeout, or our own batch deadline. When the peer ran on this host its
exit is a fact the engine can check, and that fact decides the label."""

from __future__ import annotations

import subprocess
import sys

import pytest

from transfer_svc.inflight import WRITE_DEADLINE_PASSED, failure_label
from transfer_svc.liveness import pid_start_ticks

KILLED_PEER_REASONS = [
    "UCX: Connection reset by remote peer (-25)",
    "UCX: Input/output error (-3)",
    "segment 'victim' dropped: UCX endpoint error: Endpoint timeout (-80)",
    "timed out after 5.0s",
    WRITE_DEADLINE_PASSED,
]


@pytest.mark.parametrize("reason", KILLED_PEER_REASONS)
def test_an_exited_local_owner_is_peer_unreachable_whatever_ucx_said(reason):
    assert failure_label(reason, owner_gone=True) == "peer_unreachable"


@pytest.mark.parametrize("reason,label", [
    ("UCX: Connection reset by remote peer (-25)", "peer_unreachable"),
    ("segment 'd' dropped: UCX endpoint error: Endpoint timeout (-80)", "peer_unreachable"),
    ("UCX: Not connected (-24)", "peer_unreachable"),
    ("timed out after 1.5s", "timeout"),
    (WRITE_DEADLINE_PASSED, "timeout"),
    ("segment 'd' closed by the user", "aborted"),
    ("UCX: Input/output error (-3)", "remote_error"),
    ("internal error: ValueError()", "other"),
])
def test_without_the_owner_fact_the_reason_text_decides(reason, label):
    assert failure_label(reason) == label


def test_a_killed_process_reads_as_exited_for_the_owner_check():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_start_ticks(p.pid) is not None
    finally:
        p.kill()
        p.wait()
    assert pid_start_ticks(p.pid) is None

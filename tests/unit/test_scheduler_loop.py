"""pd_common.scheduler_loop: the load query of a busy scheduler thread ends with a status."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from pd_common.inbox import LoadQuery
from pd_common.protocol import ServiceError
from pd_common.scheduler_loop import SchedulerLoop
from protos import common_pb2


class BusyLoop(SchedulerLoop):
    """A loop whose one iteration runs until ``release`` is set (a very long step)."""

    def __init__(self):
        super().__init__("busy-loop", "cpu", logging.getLogger("test.busy_loop"))
        self.release = threading.Event()
        self.step_started = threading.Event()

    def idle_wait(self) -> float:
        return 0.01

    def handle(self, msg: object) -> None:
        if isinstance(msg, LoadQuery):
            msg.reply.set_result(common_pb2.LoadReport(running_requests=7))

    def iterate(self) -> None:
        if not self.release.is_set():
            self.step_started.set()
            self.release.wait(10)

    def on_iteration_error(self) -> None:
        pass

    def live_jobs(self) -> list:
        return []

    def answer_shutdown(self, job, err: ServiceError) -> None:
        pass


@pytest.fixture
def loop():
    lp = BusyLoop()
    lp.start()
    yield lp
    lp.release.set()
    lp.stop("test over")


def test_load_of_a_busy_thread_is_unavailable_not_a_timeout_traceback(loop, caplog):
    assert loop.step_started.wait(5)
    with caplog.at_level(logging.ERROR):
        with pytest.raises(ServiceError) as ei:
            loop.load(timeout_s=0.2)
    assert ei.value.code is grpc.StatusCode.UNAVAILABLE and "within 0.2 s" in str(ei.value)
    # the late answer lands on the abandoned future without breaking the loop
    loop.release.set()
    assert loop.load(timeout_s=5).running_requests == 7
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

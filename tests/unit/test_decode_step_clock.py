"""decode_svc.step_clock: a step's wall time (its start to the next step's) split into device (inside
``device()``) and host (the rest), with the running requests summed, into D's real metric counters;
an idle loop (no running request) is never counted as a step."""

from __future__ import annotations

import time

from decode_svc.step_clock import StepClock
from telemetry import metrics as M


def _read() -> tuple[float, float, float]:
    return (M.DECODE_STEP_SECONDS.labels(part="device")._value.get(),
            M.DECODE_STEP_SECONDS.labels(part="host")._value.get(), M.DECODE_STEP_REQUESTS._value.get())


def test_steps_split_into_device_and_host_and_idle_is_not_counted():
    c = StepClock()
    d0, h0, r0 = _read()
    c.tick(4)                 # step 1: 4 requests, 50 ms in the model, 30 ms outside it
    with c.device():
        time.sleep(0.05)
    time.sleep(0.03)
    c.tick(2)                 # step 2: 2 requests, 20 ms host only
    time.sleep(0.02)
    c.tick(0)                 # the batch emptied: step 2 counted, then idle
    time.sleep(0.2)           # idle time: no step, not counted
    c.tick(0)
    d1, h1, r1 = _read()
    assert r1 - r0 == 6
    assert 0.05 <= d1 - d0 < 0.09
    assert 0.05 <= h1 - h0 < 0.15  # 30 + 20 ms, not the 200 ms idle

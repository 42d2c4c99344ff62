"""One live 1P1D stack (``halfmoon up`` machinery: :class:`halfmoon.launcher.Stack`) shared by the
bench and eval live tests of one module, started on first use and stopped (by PID: SIGTERM, then
SIGKILL) by :func:`stop` at the end of the module (its module-scoped fixture), or when the process
exits. Not kept for the whole pytest process: each xdist worker then held a ~4 GB stack for the
rest of the suite next to the stacks of later modules, and the 24 GB CI box ran out of memory.
Ports are picked free; logs go to a temp dir.
"""

from __future__ import annotations

import atexit
import json
import tempfile
from pathlib import Path

import pytest

_state: dict = {}


def endpoints_file() -> Path:
    """Path of the endpoints JSON of the shared stack (starting it on first call); skips when the
    default model is not pulled."""
    from tests.integration.conftest import MODEL, model_available

    if not model_available():
        pytest.skip(f"model {MODEL} is not pulled (run `halfmoon models pull {MODEL}`)")
    if "error" in _state:  # started once and failed: fail fast, with the same reason
        raise RuntimeError(f"the shared live stack failed to start: {_state['error']}")
    if "file" not in _state:
        from halfmoon.launcher import Stack, StackConfig

        tmp = Path(tempfile.mkdtemp(prefix="halfmoon-bench-live-"))
        stack = Stack(StackConfig(model=MODEL, base_port=0, log_dir=str(tmp / "logs"), kv_memory_mb=128.0, decode_kv_memory_mb=128.0,
                                  ready_timeout=240.0))
        atexit.register(stack.stop)
        try:
            ep = stack.start()
        except Exception as e:
            _state["error"] = f"{type(e).__name__}: {str(e)[-2000:]}"
            stack.stop()
            raise
        f = tmp / "endpoints.json"
        f.write_text(json.dumps(ep))
        _state.update(stack=stack, file=f, endpoints=ep)
    return _state["file"]


def stop() -> None:
    """Stop the shared stack if one runs (the next :func:`endpoints_file` starts a new one)."""
    stack = _state.get("stack")
    _state.clear()
    if stack is not None:
        stack.stop()


def workers() -> list[tuple[str, str]]:
    """``[(service, grpc address)]`` of the shared stack's prefill and decode workers."""
    ep = _state["endpoints"]
    return [("prefill", w["grpc"]) for w in ep["prefill"]] + [("decode", w["grpc"]) for w in ep["decode"]]


def assert_idle() -> None:
    """The KV accounting invariant on every worker once idle (free + evictable + locked + owned = pool,
    no lock, room or slot held)."""
    from tests.integration.conftest import assert_idle_accounting

    from bench.endpoints import cluster_credentials

    assert_idle_accounting(workers(), credentials=cluster_credentials(_state["endpoints"]))

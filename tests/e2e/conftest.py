"""End-to-end fixtures: the whole stack as real processes, started by ``halfmoon up``'s launcher
(:class:`halfmoon.launcher.Stack`: registry, prefill and decode workers, router; free ports; one
torch thread per worker), stopped by process group on exit. Worker-side checks reuse the
integration helpers (``tests/integration/conftest.py``: ``get_load``, ``assert_idle_accounting``).
"""

from __future__ import annotations

import contextlib

import grpc
import pytest

from halfmoon.launcher import Stack, StackConfig
from tests.integration.conftest import MODEL, model_available

pytestmark = pytest.mark.skipif(not model_available(), reason="model not pulled (halfmoon models pull)")

MAX_TOKENS = 8  # tokens an e2e request generates unless it asks for more


@contextlib.contextmanager
def running_stack(tmp_path, prefill: int, decode: int, **kw):
    cfg = StackConfig(model=MODEL, prefill=prefill, decode=decode, base_port=0, kv_memory_mb=64, decode_kv_memory_mb=64,
                      torch_threads=1, log_dir=str(tmp_path), ready_timeout=300, stop_timeout=10,
                      worker_args=["--transport", "sm", "--max-running-requests", "32"], **kw)
    with Stack(cfg) as st:
        yield st
    leftovers = [p.name for p in st.procs if p.alive()]
    assert not leftovers, f"processes left running after stop: {leftovers}"


def stack_fixture(prefill: int, decode: int, **kw):
    """A module-scoped ``stack`` fixture: the whole stack with ``prefill`` + ``decode`` workers
    (``stack = stack_fixture(1, 1)`` in a test module; ``kw``: more StackConfig fields)."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory):
        with running_stack(tmp_path_factory.mktemp(f"e2e-{prefill}p{decode}d"), prefill=prefill,
                           decode=decode, **kw) as st:
            yield st

    return stack


def greedy(max_tokens: int = MAX_TOKENS, **kw):
    """Greedy SamplingParams (``kw``: more SamplingParams fields, e.g. ignore_eos)."""
    from protos import common_pb2

    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="session")
def tok():
    from engine.model_store import resolve_model
    from router_svc.tokenizer import RouterTokenizer

    return RouterTokenizer(MODEL, resolve_model(MODEL))


def router_stub(stack: Stack):
    from protos import router_pb2_grpc

    from security.call_metadata import bearer_channel

    ch = bearer_channel(stack.endpoints["router"]["grpc"], stack.endpoints.get("api_key"))
    return ch, router_pb2_grpc.RouterStub(ch)


@pytest.fixture(scope="module")
def stub(stack):
    """Router gRPC stub of the module's ``stack`` fixture."""
    ch, s = router_stub(stack)
    yield s
    ch.close()


@pytest.fixture(scope="module")
def client(stack):
    """The real ``openai`` client on the module's ``stack`` router (no client-side retries)."""
    import openai

    return openai.OpenAI(base_url=f"http://{stack.endpoints['router']['http']}/v1", api_key=stack.endpoints.get("api_key") or "unused",
                         max_retries=0)


def worker_targets(stack: Stack, alive_only: bool = True) -> list[tuple[str, str]]:
    """(service, address) of every worker, for assert_idle_accounting."""
    out = []
    for role in ("prefill", "decode"):
        for w in stack.endpoints[role]:
            proc = next(p for p in stack.procs if p.name == w["worker_id"])
            if proc.alive() or not alive_only:
                out.append((role, w["grpc"]))
    return out


def reference_ids(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output of the co-located engine for the same prompts (all batched)."""
    from tests.integration.pd_driver import colocated_generate

    return colocated_generate(prompts, max_tokens)

"""Cluster identity on real stacks (docs/security.md): every worker and registry RPC needs the
cluster token (``halfmoon up``'s default) or, under ``--tls``, a client certificate from the
cluster CA; the whole stack serves greedy output under mTLS with certificates from ``halfmoon certs``.

Two module stacks of 1P1D: the default (token) one and an mTLS one.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from halfmoon.launcher import StackConfig
from halfmoon.stack_credentials import AuthMode
from protos import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc, registry_pb2, registry_pb2_grpc, router_pb2
from security import OPEN, ClusterCredentials
from tests.e2e.conftest import MAX_TOKENS, greedy, reference_ids, router_stub, running_stack, worker_targets
from tests.integration.conftest import MODEL, ROOT, assert_idle_accounting

PROMPT = "The lighthouse keeper climbed the stairs and"


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory):
    assert StackConfig().auth is AuthMode.TOKEN  # what `halfmoon up` does without flags
    with running_stack(tmp_path_factory.mktemp("auth-token"), prefill=1, decode=1) as st:
        yield st


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory):
    """Certificates made by the real CLI, one per role (``up`` falls back from prefill-0 to prefill)."""
    out = tmp_path_factory.mktemp("certs")
    r = subprocess.run([sys.executable, "-m", "halfmoon", "certs", "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory, certs_dir):
    with running_stack(tmp_path_factory.mktemp("auth-tls"), prefill=1, decode=1, auth=AuthMode.TLS,
                       tls_dir=str(certs_dir)) as st:
        yield st


def _calls(stack, creds: ClusterCredentials):
    """One RPC per service of ``stack`` (registry unary + stream, prefill, decode unary + stream),
    made with ``creds`` -> {name: status code}."""
    ep = stack.endpoints
    out = {}

    def run(name, fn):
        try:
            fn()
            out[name] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            out[name] = e.code()

    with creds.channel(ep["registry"]["grpc"]) as ch:
        reg = registry_pb2_grpc.RegistryStub(ch)
        run("registry.GetSegment", lambda: reg.GetSegment(registry_pb2.GetSegmentRequest(name="decode-0"), timeout=10))
        run("registry.WatchWorkers",
            lambda: next(iter(reg.WatchWorkers(registry_pb2.WatchWorkersRequest(), timeout=10))))
    with creds.channel(ep["prefill"][0]["grpc"]) as ch:
        run("prefill.GetLoad", lambda: prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10))
    with creds.channel(ep["decode"][0]["grpc"]) as ch:
        d = decode_pb2_grpc.DecodeStub(ch)
        run("decode.GetLoad", lambda: d.GetLoad(common_pb2.GetLoadRequest(), timeout=10))
        # an empty Generate: with credentials it is refused for its content, without before it is read
        run("decode.Generate", lambda: list(d.Generate(decode_pb2.DecodeRequest(), timeout=10)))
    return out


SERVICES = ["registry.GetSegment", "registry.WatchWorkers", "prefill.GetLoad", "decode.GetLoad", "decode.Generate"]


def test_every_service_refuses_rpcs_without_the_cluster_token(token_stack):
    ep = token_stack.endpoints
    assert ep["auth"] == "token" and len(ep["cluster_token"]) >= 32
    for creds in (OPEN, ClusterCredentials(token="a-wrong-token-of-enough-length")):
        got = _calls(token_stack, creds)
        assert got == {s: grpc.StatusCode.UNAUTHENTICATED for s in SERVICES}, got


def test_every_service_answers_with_the_cluster_token(token_stack):
    got = _calls(token_stack, token_stack.credentials.client())
    bad_input = got.pop("decode.Generate")
    assert got == {s: grpc.StatusCode.OK for s in SERVICES if s != "decode.Generate"}, got
    assert bad_input == grpc.StatusCode.INVALID_ARGUMENT  # read and judged: the token let it in
    assert_idle_accounting(worker_targets(token_stack), credentials=token_stack.credentials.client())


def test_health_stays_open_and_the_token_is_not_in_argv(token_stack):
    ep = token_stack.endpoints
    for addr in [ep["registry"]["grpc"], ep["prefill"][0]["grpc"], ep["decode"][0]["grpc"]]:
        with grpc.insecure_channel(addr) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
    token = ep["cluster_token"].encode()
    for p in token_stack.procs:
        with open(f"/proc/{p.popen.pid}/cmdline", "rb") as f:
            assert token not in f.read(), p.name
    assert (token_stack.log_dir / "cluster-token").stat().st_mode & 0o077 == 0


def test_mtls_refuses_clients_without_a_cert_or_with_another_cas(tls_stack, tmp_path):
    from security.certs import write_dev_certs

    assert tls_stack.endpoints["auth"] == "tls" and "cluster_token" not in tls_stack.endpoints
    ca = tls_stack.credentials.certs["client"].ca.read_bytes()
    other = write_dev_certs(tmp_path / "other-ca", ["client"])["client"]
    impostor = ClusterCredentials.load(tls_cert=str(other.cert), tls_key=str(other.key), tls_ca=str(other.ca))
    # a client that trusts the cluster CA but presents a cert of another CA
    mixed = ClusterCredentials.load(tls_cert=str(other.cert), tls_key=str(other.key),
                                    tls_ca=str(tls_stack.credentials.certs["client"].ca))
    for creds in (OPEN, impostor, mixed):
        got = _calls(tls_stack, creds)
        assert got == {s: grpc.StatusCode.UNAVAILABLE for s in SERVICES}, got
    for service in ("registry", "prefill"):  # server-verified TLS without a client cert
        addr = tls_stack.endpoints[service]["grpc"] if service == "registry" else \
            tls_stack.endpoints[service][0]["grpc"]
        with grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca)) as ch:
            with pytest.raises(grpc.RpcError) as ei:
                prefill_pb2_grpc.PrefillStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    got = _calls(tls_stack, tls_stack.credentials.client())
    assert got.pop("decode.Generate") == grpc.StatusCode.INVALID_ARGUMENT
    assert set(got.values()) == {grpc.StatusCode.OK}, got


def test_whole_stack_under_mtls_serves_greedy_output(tls_stack, tok):
    ep = tls_stack.endpoints
    ref = reference_ids([tok.encode(PROMPT)], MAX_TOKENS)[0]
    client = openai.OpenAI(base_url=f"http://{ep['router']['http']}/v1", api_key=ep.get("api_key") or "unused",
                           max_retries=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == tok.hf.decode(ref, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ref)
    ch, stub = router_stub(tls_stack)
    with ch:
        resps = list(stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=greedy()), timeout=120))
    assert [t for x in resps for t in x.token_ids] == ref
    assert resps[-1].usage.kv_pages_transferred > 0 or resps[-1].usage.decode_prefix_tokens > 0
    assert_idle_accounting(worker_targets(tls_stack), credentials=tls_stack.credentials.client())

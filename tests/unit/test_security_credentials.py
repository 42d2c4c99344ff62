"""security/: dev certificates (``halfmoon certs``), credential loading and its errors, the token
interceptors on a real in-process gRPC server (sync and aio), and start-up with bad credential
flags (one ``error:`` line, no traceback)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from protos import registry_pb2, registry_pb2_grpc
from security import OPEN, TOKEN_ENV, ClusterCredentials, CredentialsError
from security.certs import write_dev_certs

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return write_dev_certs(tmp_path_factory.mktemp("certs"), ["registry", "client"], hosts=["10.1.2.3", "node-a"])


def test_dev_certs_chain_to_the_ca_with_the_sans_and_private_keys(certs):
    c = certs["registry"]
    ca = x509.load_pem_x509_certificate(c.ca.read_bytes())
    leaf = x509.load_pem_x509_certificate(c.cert.read_bytes())
    leaf.verify_directly_issued_by(ca)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == {"registry", "localhost", "node-a"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.1.2.3"}
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {u._name for u in eku} == {"serverAuth", "clientAuth"}
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for key in (c.key, c.ca.with_name("ca-key.pem")):
        assert key.stat().st_mode & 0o077 == 0, key
    # a second run reuses the CA: old and new leaves chain to the same one
    again = write_dev_certs(c.ca.parent, ["router"])["router"]
    x509.load_pem_x509_certificate(again.cert.read_bytes()).verify_directly_issued_by(ca)


def test_certs_cli_writes_usable_flags(tmp_path):
    r = subprocess.run([sys.executable, "-m", "halfmoon", "certs", "--out", str(tmp_path), "--services", "registry"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    flags = r.stdout.splitlines()[1].split()[1:]
    creds = ClusterCredentials.load(tls_cert=flags[1], tls_key=flags[3], tls_ca=flags[5])
    assert creds.mode == "mtls" and creds.tls.cert_path == str(tmp_path / "registry.pem")
    bad = subprocess.run([sys.executable, "-m", "halfmoon", "certs", "--out", str(tmp_path), "--services", "a b"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "service name 'a b'" in bad.stderr and "Traceback" not in bad.stderr


def test_token_sources_and_precedence(tmp_path):
    f = tmp_path / "tok"
    f.write_text("f" * 20 + "\nignored\n")
    env = {TOKEN_ENV: "e" * 20}
    assert ClusterCredentials.load(token="a" * 20, token_file=str(f), env=env).token == "a" * 20
    assert ClusterCredentials.load(token_file=str(f), env=env).token == "f" * 20
    assert ClusterCredentials.load(env=env).token == "e" * 20
    assert ClusterCredentials.load(env={}) == OPEN and OPEN.mode == "open"
    creds = ClusterCredentials(token=TOKEN)
    assert TOKEN not in repr(creds) and creds.mode == "token"
    assert creds.metadata() == (("x-halfmoon-cluster-token", TOKEN),) and OPEN.metadata() == ()


@pytest.mark.parametrize("kwargs, message", [
    ({"token_file": "/nonexistent/tok"}, "--cluster-token-file /nonexistent/tok: No such file"),
    ({"token": "short"}, "at least 16 characters"),
    ({"tls_cert": "/x.pem"}, "--tls-cert given without --tls-ca, --tls-key"),
    ({"tls_cert": "/nonexistent.pem", "tls_key": "/k", "tls_ca": "/c"}, "--tls-cert /nonexistent.pem: No such file"),
])
def test_bad_credentials_name_the_flag(kwargs, message):
    with pytest.raises(CredentialsError, match=message.replace("(", r"\(")):
        ClusterCredentials.load(env={}, **kwargs)


def test_empty_token_file_and_bad_pem_and_foreign_key(tmp_path, certs):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(CredentialsError, match="the file is empty"):
        ClusterCredentials.load(token_file=str(empty), env={})
    reg, cli = certs["registry"], certs["client"]
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(CredentialsError, match="--tls-cert .*junk.pem: not a PEM certificate"):
        ClusterCredentials.load(tls_cert=str(junk), tls_key=str(reg.key), tls_ca=str(reg.ca))
    with pytest.raises(CredentialsError, match="--tls-ca .*junk.pem: not a PEM certificate"):
        ClusterCredentials.load(tls_cert=str(reg.cert), tls_key=str(reg.key), tls_ca=str(junk))
    with pytest.raises(CredentialsError, match="--tls-key .*junk.pem: not an unencrypted PEM private key"):
        ClusterCredentials.load(tls_cert=str(reg.cert), tls_key=str(junk), tls_ca=str(reg.ca))
    with pytest.raises(CredentialsError, match="is not the key of --tls-cert"):
        ClusterCredentials.load(tls_cert=str(reg.cert), tls_key=str(cli.key), tls_ca=str(reg.ca))


@pytest.mark.parametrize("command", ["serve-transfer", "serve-prefill", "serve-router"])
def test_bad_credential_flags_stop_start_up_with_one_line(command, tmp_path):
    """Before any model, port or registry: an ``error`` line naming the flag, exit != 0, no traceback."""
    r = subprocess.run([sys.executable, "-m", "halfmoon", command, "--port", "0", "--registry", "127.0.0.1:1",
                        "--cluster-token-file", str(tmp_path / "missing")] if command != "serve-transfer" else
                       [sys.executable, "-m", "halfmoon", command, "--port", "0", "--metrics-port", "-1",
                        "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", "k", "--tls-ca", "ca"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    flag = "--tls-cert" if command == "serve-transfer" else "--cluster-token-file"
    assert f"{flag} {tmp_path}" in r.stderr and "No such file" in r.stderr, r.stderr


def _registry(creds):
    from transfer_svc.registry import serve

    server, _, port = serve(port=0, credentials=creds)
    return server, f"127.0.0.1:{port}"


def test_sync_interceptor_refuses_unary_and_streams_without_the_token():
    server, addr = _registry(ClusterCredentials(token=TOKEN))
    try:
        for creds, want in ((OPEN, grpc.StatusCode.UNAUTHENTICATED),
                            (ClusterCredentials(token="w" * 32), grpc.StatusCode.UNAUTHENTICATED),
                            (ClusterCredentials(token=TOKEN), grpc.StatusCode.NOT_FOUND)):
            with creds.channel(addr) as ch:
                stub = registry_pb2_grpc.RegistryStub(ch)
                with pytest.raises(grpc.RpcError) as ei:
                    stub.GetSegment(registry_pb2.GetSegmentRequest(name="nobody"), timeout=5)
                assert ei.value.code() == want
                if want == grpc.StatusCode.UNAUTHENTICATED:
                    assert TOKEN not in ei.value.details()
                    with pytest.raises(grpc.RpcError) as ei:
                        next(iter(stub.WatchWorkers(registry_pb2.WatchWorkersRequest(), timeout=5)))
                    assert ei.value.code() == want
        # invalid UTF-8 from an unauthenticated caller: UNAUTHENTICATED, the bytes are never parsed
        bad = registry_pb2.GetSegmentRequest(name="x").SerializeToString().replace(b"x", b"\xff")
        with grpc.insecure_channel(addr) as ch:
            call = ch.unary_unary("/halfmoon.v1.Registry/GetSegment", request_serializer=None,
                                  response_deserializer=None)
            with pytest.raises(grpc.RpcError) as ei:
                call(bad, timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with ClusterCredentials(token=TOKEN).channel(addr) as ch:
            call = ch.unary_unary("/halfmoon.v1.Registry/GetSegment", request_serializer=None,
                                  response_deserializer=None)
            with pytest.raises(grpc.RpcError) as ei:
                call(bad, timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # the request guard stays in the chain
    finally:
        server.stop(0)


def test_aio_interceptor_and_aio_channels():
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer

    from protos.request_guard import AioInvalidRequestInterceptor

    async def main():
        creds = ClusterCredentials(token=TOKEN)
        server = grpc.aio.server(interceptors=[*creds.aio_server_interceptors(), AioInvalidRequestInterceptor()])
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
        registry_pb2_grpc.add_RegistryServicer_to_server(registry_pb2_grpc.RegistryServicer(), server)
        port = creds.add_port(server, "127.0.0.1:0")
        await server.start()
        addr = f"127.0.0.1:{port}"
        try:
            codes = []
            for c in (OPEN, creds):
                async with c.aio_channel(addr) as ch:
                    try:
                        await registry_pb2_grpc.RegistryStub(ch).GetSegment(registry_pb2.GetSegmentRequest(), timeout=5)
                    except grpc.aio.AioRpcError as e:
                        codes.append(e.code())
                    # health stays open (kubelet probes send no metadata)
                    r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                    assert r.status == health_pb2.HealthCheckResponse.SERVING
            return codes
        finally:
            await server.stop(0)

    # the servicer base class answers UNIMPLEMENTED: reached only with the token
    assert asyncio.run(main()) == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED]


def test_mtls_needs_a_client_cert_of_the_cluster_ca(certs, tmp_path):
    reg, cli = certs["registry"], certs["client"]
    load = lambda c: ClusterCredentials.load(tls_cert=str(c.cert), tls_key=str(c.key), tls_ca=str(c.ca))  # noqa: E731
    server, addr = _registry(load(reg))
    other = write_dev_certs(tmp_path, ["client"])["client"]
    try:
        for creds, want in ((OPEN, grpc.StatusCode.UNAVAILABLE), (load(other), grpc.StatusCode.UNAVAILABLE),
                            (load(cli), grpc.StatusCode.NOT_FOUND)):
            with creds.channel(addr) as ch:
                with pytest.raises(grpc.RpcError) as ei:
                    registry_pb2_grpc.RegistryStub(ch).GetSegment(registry_pb2.GetSegmentRequest(name="n"), timeout=5)
                assert ei.value.code() == want, creds.mode
    finally:
        server.stop(0)
    assert isinstance(x509.load_pem_x509_certificate(cli.cert.read_bytes()).public_key(), ec.EllipticCurvePublicKey)

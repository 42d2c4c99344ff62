"""What ``halfmoon up`` hands its processes (halfmoon/stack_credentials.py): token files, API key
file, per-process certificates, the ENDPOINTS fields, and the errors of a bad ``--tls-dir``."""

from __future__ import annotations

import pytest

from halfmoon.stack_credentials import AuthMode, prepare
from security import OPEN, ClusterCredentials
from security.certs import write_dev_certs

NAMES = ["registry", "router", "prefill-0", "decode-0"]


def test_token_mode_makes_private_files_and_passes_paths_only(tmp_path):
    a, b = prepare(AuthMode.TOKEN, tmp_path, NAMES), prepare(AuthMode.TOKEN, tmp_path / ".." / tmp_path.name, NAMES)
    assert a.cluster_token != b.cluster_token and len(a.cluster_token) >= 32   # ephemeral: new each up
    for f in (b.token_file, b.api_key_file):
        assert f.stat().st_mode & 0o777 == 0o600
    assert b.token_file.read_text().strip() == b.cluster_token
    assert b.api_key_file.read_text() == f"default {b.api_key}\n"
    argv = b.process_args("prefill-0")
    assert argv == ["--cluster-token-file", str(b.token_file)] and b.cluster_token not in " ".join(argv)
    assert ClusterCredentials.from_args(type("A", (), dict(cluster_token=None, cluster_token_file=argv[1],
                                                          tls_cert=None, tls_key=None, tls_ca=None))(),
                                        env={}).token == b.cluster_token
    fields = b.endpoints_fields()
    assert fields["auth"] == "token" and fields["cluster_token"] == b.cluster_token and "tls" not in fields
    assert fields["api_key"] == b.api_key and b.router_args() == ["--api-key-file", str(b.api_key_file)]
    assert b.client().token == b.cluster_token
    assert repr(b).count(b.cluster_token) == 0 and b.api_key not in repr(b)


def test_tls_mode_without_a_dir_makes_one_cert_per_process(tmp_path):
    c = prepare(AuthMode.TLS, tmp_path, NAMES, hosts=("127.0.0.1",))
    assert c.cluster_token is None and c.process_args("decode-0")[:2] == ["--tls-cert", str(tmp_path / "certs" / "decode-0.pem")]
    assert c.client().mode == "mtls"
    assert c.endpoints_fields()["tls"]["cert"] == str(tmp_path / "certs" / "client.pem")


def test_tls_dir_from_halfmoon_certs_falls_back_to_the_role(tmp_path):
    write_dev_certs(tmp_path / "d", ["registry", "router", "prefill", "decode", "client"])
    c = prepare(AuthMode.TLS, tmp_path, NAMES + ["decode-1"], tls_dir=str(tmp_path / "d"))
    assert c.process_args("decode-1")[1] == str(tmp_path / "d" / "decode.pem")
    write_dev_certs(tmp_path / "e", ["registry", "router", "prefill", "client"])
    with pytest.raises(ValueError, match="no certificate for 'decode-0'"):
        prepare(AuthMode.TLS, tmp_path, NAMES, tls_dir=str(tmp_path / "e"))
    with pytest.raises(ValueError, match="no ca.pem"):
        prepare(AuthMode.TLS, tmp_path, NAMES, tls_dir=str(tmp_path / "nothing"))


def test_open_mode_hands_out_nothing(tmp_path):
    o = prepare(AuthMode.OPEN, tmp_path, NAMES)
    assert o.process_args("registry") == [] and o.router_args() == [] and o.client() == OPEN
    assert o.endpoints_fields() == {"auth": "open"} and not list(tmp_path.iterdir())

"""The Helm chart's registry backends (issue 21): the embedded memory registry (one replica,
Recreate) or an existing etcd (`registry.backend: etcd`): endpoints, key prefix and TLS from an
existing Secret become `serve-transfer --registry-backend etcd ...` flags, the Secret is mounted,
and any number of replicas may run. Rendered offline (helm template) and validated like the rest
of the chart (tests/integration/test_deploy_chart.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_deploy_chart import (_PARSE_ARGS, CHART, ROOT, _by, _helm, _kubernetes_validate,
                                                 _render, _run)
from tests.integration.test_deploy_chart_security import _flag, _mounted_file

ENDPOINTS = ["--set-json", 'registry.etcd.endpoints=["etcd-0.etcd.db:2379","etcd-1.etcd.db:2379"]']
ETCD = ["--set", "registry.backend=etcd,registry.replicas=3", *ENDPOINTS]
ETCD_TLS = [*ETCD, "--set", "registry.etcd.tls.existingSecret=etcd-client"]


def _registry(docs):
    return _by(docs, "Deployment", "hm-halfmoon-registry")


@pytest.mark.parametrize("values", [ETCD, ETCD_TLS], ids=["etcd", "etcd-tls"])
def test_etcd_values_lint_and_validate(values, tmp_path):
    _run([_helm(), "lint", "--strict", str(CHART), *values])
    docs = _render(*values)
    proc = _kubernetes_validate(docs, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed for resource") == len(docs), proc.stdout


def test_memory_is_the_default_one_replica_recreate():
    reg = _registry(_render())
    assert reg["spec"]["replicas"] == 1 and reg["spec"]["strategy"]["type"] == "Recreate"
    args = reg["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if "etcd" in a], args


def test_etcd_backend_args_replicas_and_default_prefix():
    reg = _registry(_render(*ETCD))
    assert reg["spec"]["replicas"] == 3 and reg["spec"]["strategy"]["type"] == "RollingUpdate"
    spec = reg["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert _flag(args, "--registry-backend") == "etcd"
    assert _flag(args, "--etcd-endpoints") == "etcd-0.etcd.db:2379,etcd-1.etcd.db:2379"
    assert _flag(args, "--etcd-prefix") == "/halfmoon/serving/hm-halfmoon/"  # one per release
    assert "--etcd-ca" not in args and "--etcd-cert" not in args
    assert "etcd-tls" not in {v["name"] for v in spec["volumes"]}
    # workers and the router still speak only to the registry Service
    for comp in ("prefill", "decode", "router"):
        c_args = _by(_render(*ETCD), "Deployment", f"hm-halfmoon-{comp}")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert _flag(c_args, "--registry") == "hm-halfmoon-registry:50050"
        assert not [a for a in c_args if "etcd" in a], (comp, c_args)
    named = _registry(_render(*ETCD, "--set", "registry.etcd.prefix=/prod/hm/"))
    assert _flag(named["spec"]["template"]["spec"]["containers"][0]["args"], "--etcd-prefix") == "/prod/hm/"


def test_etcd_tls_secret_is_mounted_and_passed():
    spec = _registry(_render(*ETCD_TLS))["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    for flag, key in (("--etcd-ca", "ca.crt"), ("--etcd-cert", "tls.crt"), ("--etcd-key", "tls.key")):
        assert _mounted_file(spec, _flag(args, flag)) == ("etcd-client", key), flag
    # server verification only: CA without a client certificate
    spec = _registry(_render(*ETCD_TLS, "--set", "registry.etcd.tls.certKey=,registry.etcd.tls.keyKey=,"
                                                  "registry.etcd.tls.caKey=root.pem"))["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert _mounted_file(spec, _flag(args, "--etcd-ca")) == ("etcd-client", "root.pem")
    assert "--etcd-cert" not in args and "--etcd-key" not in args
    # only the registry talks to etcd: no other pod gets the etcd Secret
    docs = _render(*ETCD_TLS)
    for comp in ("prefill", "decode", "router"):
        vols = _by(docs, "Deployment", f"hm-halfmoon-{comp}")["spec"]["template"]["spec"]["volumes"]
        assert "etcd-client" not in {v.get("secret", {}).get("secretName") for v in vols}, comp


def test_etcd_args_parse_with_the_real_cli():
    args = _registry(_render(*ETCD_TLS))["spec"]["template"]["spec"]["containers"][0]["args"]
    proc = subprocess.run([sys.executable, "-c", _PARSE_ARGS], input=json.dumps([args]), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("bad, message", [
    ("registry.backend=consul", "registry.backend must be one of the following"),
    ("registry.backend=etcd", "registry.etcd.endpoints is required with registry.backend etcd"),
    ("registry.replicas=2", "registry.replicas > 1 needs registry.backend etcd"),
    ("registry.replicas=0", "registry.replicas: Must be greater than or equal to 1"),
    ("registry.etcd.endpoints[0]=etcd:2379", "registry.etcd.* is set but registry.backend is memory"),
    ("registry.backend=etcd,registry.etcd.endpoints[0]=http://etcd:2379", "registry.etcd.endpoints.0: Does not match"),
    ("registry.backend=etcd,registry.etcd.endpoints[0]=etcd:2379,registry.etcd.prefix=halfmoon",
     "registry.etcd.prefix: Does not match"),
    ("registry.backend=etcd,registry.etcd.endpoints[0]=etcd:2379,registry.etcd.tls.existingSecret=s,"
     "registry.etcd.tls.keyKey=", "registry.etcd.tls.certKey and keyKey go together"),
    ("registry.etcd.tls.secret=s", "Additional property secret is not allowed"),
], ids=["backend", "no-endpoints", "memory-replicas", "zero-replicas", "memory-etcd", "url", "prefix",
        "cert-without-key", "typo"])
def test_bad_registry_values_are_rejected(bad, message):
    proc = subprocess.run([_helm(), "template", "hm", str(CHART), "--set", bad], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr

"""The Helm chart (deploy/k8s/halfmoon): lint, render, validate against Kubernetes 1.32 schemas.

Tools come from `make tools` (scripts/install-tools.sh): helm in tools/bin, kubernetes-validate and
cloudcoil-models-prometheus-operator in the venv. Built-in kinds go through
`kubernetes-validate --strict -k 1.32.0` (unknown fields rejected); the Prometheus Operator CRDs
(ServiceMonitor, PrometheusRule) through cloudcoil's pydantic models with extra fields forbidden.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "k8s" / "halfmoon"
GPU_VALUES = CHART / "values-gpu.yaml"
KUBE_VERSION = "1.32.0"
CRD_GROUP = "monitoring.coreos.com/"
# Everything optional switched on, so every template renders.
ALL_ON = ["--set", "metrics.serviceMonitor.enabled=true,metrics.prometheusRule.enabled=true,"
          "metrics.dashboard.enabled=true,prefill.hpa.enabled=true,decode.hpa.enabled=true"]


def _helm() -> str:
    helm = ROOT / "tools" / "bin" / "helm"
    if not helm.exists():
        pytest.fail(f"{helm} missing: run `make tools` (scripts/install-tools.sh)")
    return str(helm)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _render(*extra: str) -> list[dict]:
    out = _run([_helm(), "template", "hm", str(CHART), "--namespace", "serving", *extra]).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _kubernetes_validate(docs: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "kubernetes-validate"
    if not exe.exists():
        exe = shutil.which("kubernetes-validate")
        if exe is None:
            pytest.fail("kubernetes-validate missing: run `make tools`")
    path = tmp_path / "manifests.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([str(exe), "--strict", "-k", KUBE_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)


def _validate_crd(doc: dict) -> None:
    from cloudcoil.models.prometheus_operator import v1

    getattr(v1, doc["kind"]).model_validate(doc, extra="forbid")


def _by(docs: list[dict], kind: str, name: str) -> dict:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind}/{name} in {[(d['kind'], d['metadata']['name']) for d in docs]}")


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)], ALL_ON], ids=["default", "gpu", "all-on"])
def test_lint_strict(values):
    _run([_helm(), "lint", "--strict", str(CHART), *values])


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)], ALL_ON], ids=["default", "gpu", "all-on"])
def test_rendered_manifests_validate(values, tmp_path):
    docs = _render(*values)
    builtin = [d for d in docs if not d["apiVersion"].startswith(CRD_GROUP)]
    crds = [d for d in docs if d["apiVersion"].startswith(CRD_GROUP)]
    proc = _kubernetes_validate(builtin, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed for resource") == len(builtin), proc.stdout
    for doc in crds:
        _validate_crd(doc)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    if values:  # gpu and all-on enable the monitoring objects and HPAs
        assert {"ServiceMonitor", "PrometheusRule", "HorizontalPodAutoscaler"} <= kinds


def test_validators_reject_unknown_fields(tmp_path):
    """The checks above can fail: a misspelt field is caught by both validators."""
    docs = _render(*ALL_ON)
    deploy = copy.deepcopy(_by(docs, "Deployment", "hm-halfmoon-decode"))
    deploy["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    proc = _kubernetes_validate([deploy], tmp_path)
    assert proc.returncode != 0 and "grpcc" in proc.stdout + proc.stderr
    sm = copy.deepcopy(_by(docs, "ServiceMonitor", "hm-halfmoon"))
    sm["spec"]["endpoints"][0]["intervall"] = "5s"
    with pytest.raises(Exception, match="intervall"):
        _validate_crd(sm)


def test_workers_register_with_pod_ip_and_grpc_probes():
    docs = _render()
    registry = "hm-halfmoon-registry:50050"
    for role, port in (("prefill", 50052), ("decode", 50053)):
        dep = _by(docs, "Deployment", f"hm-halfmoon-{role}")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        args = c["args"]
        assert args[0] == f"serve-{role}"
        flags = dict(zip(args[1::2], args[2::2]))
        assert flags == {"--model": "smollm2-135m-instruct", "--host": "0.0.0.0", "--port": str(port),
                         "--metrics-port": "9400", "--registry": registry, "--advertise-host": "$(POD_IP)",
                         "--worker-id": "$(POD_NAME)", "--device": "cpu", "--transport": "tcp",
                         "--page-size": "16", "--cluster-token-file": "/etc/halfmoon/cluster-token/token",
                         "--drain-grace-s": {"prefill": "40", "decode": "100"}[role], "--tp": "1"}
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == port
        svc = _by(docs, "Service", f"hm-halfmoon-{role}")
        assert svc["spec"]["clusterIP"] == "None"  # headless
        assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "metrics"}
        init = dep["spec"]["template"]["spec"]["initContainers"][0]
        assert init["args"] == ["models", "pull", "smollm2-135m-instruct"]
    router = _by(docs, "Deployment", "hm-halfmoon-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][:1] == ["serve-router"]
    flags = dict(zip(router["args"][1::2], router["args"][2::2]))
    assert flags == {"--model": "smollm2-135m-instruct", "--host": "0.0.0.0", "--port": "50051",
                     "--http-port": "8000", "--metrics-port": "9400", "--registry": registry,
                     "--prefill-policy": "cache_aware", "--decode-policy": "cache_aware", "--page-size": "16",
                     "--policy": "per_role", "--migration-limit": "3",
                     "--cluster-token-file": "/etc/halfmoon/cluster-token/token",
                     "--api-key-file": "/etc/halfmoon/api-keys/api-keys"}
    # NOT_SERVING while no worker pair is healthy must not restart the router: liveness is a TCP check
    assert router["livenessProbe"]["tcpSocket"]["port"] == 50051
    assert router["readinessProbe"]["grpc"]["port"] == 50051
    reg = _by(docs, "Deployment", "hm-halfmoon-registry")
    assert reg["spec"]["replicas"] == 1 and reg["spec"]["strategy"]["type"] == "Recreate"
    assert reg["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "serve-transfer", "--host", "0.0.0.0", "--port", "50050", "--metrics-port", "9400",
        "--cluster-token-file", "/etc/halfmoon/cluster-token/token"]
    cm = _by(docs, "ConfigMap", "hm-halfmoon")
    assert cm["data"]["HALFMOON_METRICS_HOST"] == "0.0.0.0"


def test_gpu_values_request_gpus_and_cuda_image():
    docs = _render("-f", str(GPU_VALUES))
    for role in ("prefill", "decode"):
        spec = _by(docs, "Deployment", f"hm-halfmoon-{role}")["spec"]
        assert "replicas" not in spec  # the HPA owns the replica count
        c = spec["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"] == "halfmoon:0.1.0-cuda"
        flags = dict(zip(c["args"][1::2], c["args"][2::2]))
        assert flags["--device"] == "cuda" and "cuda_ipc" in flags["--transport"]
        # a chat without max_tokens asks for the rest of the served window: D's pool must hold one
        # (56 KiB per token for Qwen2.5-7B bf16), not the CPU default of 512 MiB (~9k tokens)
        assert flags["--max-context"] == "32768"
        kv_mb = float(flags["--kv-memory-mb"])
        assert kv_mb * 2**20 >= 32768 * 56 * 1024 * (8 if role == "decode" else 1), (role, kv_mb)
        hpa = _by(docs, "HorizontalPodAutoscaler", f"hm-halfmoon-{role}")
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"].startswith(f"halfmoon_{role}_")
    router = _by(docs, "Deployment", "hm-halfmoon-router")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})


def test_tp_values_reach_args_gpus_and_nccl_env():
    """prefill/decode ``tp``: ``--tp``, gpus per rank times tp, and the NCCL env on CUDA only."""
    def worker(docs, role):
        return _by(docs, "Deployment", f"hm-halfmoon-{role}")["spec"]["template"]["spec"]["containers"][0]

    docs = _render("-f", str(GPU_VALUES), "--set", "prefill.tp=2,decode.tp=4")
    for role, tp in (("prefill", 2), ("decode", 4)):
        c = worker(docs, role)
        assert dict(zip(c["args"][1::2], c["args"][2::2]))["--tp"] == str(tp)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_DEBUG"] == "WARN"
    cpu = worker(_render("--set", "prefill.tp=2"), "prefill")  # gloo on CPU: no GPU, no NCCL env
    assert dict(zip(cpu["args"][1::2], cpu["args"][2::2]))["--tp"] == "2"
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert not any(e["name"].startswith("NCCL_") for e in cpu["env"])
    default = worker(_render("-f", str(GPU_VALUES)), "decode")
    assert default["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not any(e["name"].startswith("NCCL_") for e in default["env"])


def test_monitoring_objects_carry_the_repo_rules_and_dashboard():
    docs = _render(*ALL_ON)
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    assert _by(docs, "PrometheusRule", "hm-halfmoon")["spec"]["groups"] == rules["groups"]
    cm = _by(docs, "ConfigMap", "hm-halfmoon-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "halfmoon-dashboard.json").read_text())
    assert json.loads(cm["data"]["halfmoon-dashboard.json"]) == dashboard
    sm = _by(docs, "ServiceMonitor", "hm-halfmoon")
    assert sm["spec"]["jobLabel"] == "halfmoon.io/job"
    jobs = {d["metadata"]["labels"]["halfmoon.io/job"] for d in docs if d["kind"] == "Service"}
    assert jobs == {"halfmoon-router", "halfmoon-prefill", "halfmoon-decode", "halfmoon-registry"}
    # the chart's copies are byte-identical to the canonical files
    for canonical, copy_ in (("deploy/prometheus/rules.yaml", "files/rules.yaml"),
                             ("deploy/grafana/halfmoon-dashboard.json", "files/halfmoon-dashboard.json")):
        assert (ROOT / canonical).read_bytes() == (CHART / copy_).read_bytes(), (
            f"{CHART / copy_} differs from {canonical}: run deploy/grafana/build_dashboard.py / copy rules.yaml")


_PARSE_ARGS = """
import argparse, json, sys
from halfmoon.cli import COMMANDS
import importlib
errors = {}
for argv in json.loads(sys.stdin.read()):
    mod = importlib.import_module(COMMANDS[argv[0]][0])
    parser = argparse.ArgumentParser(prog=argv[0], exit_on_error=False)
    mod.add_arguments(parser)
    try:
        ns, unknown = parser.parse_known_args(argv[1:])
        if unknown:
            errors[argv[0]] = f"unknown arguments {unknown}"
    except (argparse.ArgumentError, SystemExit) as exc:
        errors[argv[0]] = repr(exc)
print(json.dumps(errors))
"""


def test_chart_args_parse_with_the_real_cli():
    """Every container's args (GPU values, all options on) are accepted by that subcommand's parser."""
    docs = _render("-f", str(GPU_VALUES)) + _render()
    argvs = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            argvs.append([a.replace("$(POD_IP)", "10.1.2.3").replace("$(POD_NAME)", "pod-0") for a in c["args"]])
    assert {a[0] for a in argvs} == {"serve-transfer", "serve-router", "serve-prefill", "serve-decode", "models"}
    proc = subprocess.run([sys.executable, "-c", _PARSE_ARGS], input=json.dumps(argvs), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


@pytest.mark.parametrize("bad, message", [
    ("image.variant=rocm", "image.variant must be one of the following"),
    ("prefill.gpuss=1", "Additional property gpuss is not allowed"),
    ("decode.port=70000", "decode.port: Must be less than or equal to 65535"),
    ("router.prefillPolicy=random", "router.prefillPolicy must be one of the following"),
    ("cache.volume.hostPath.path=/m,cache.volume.persistentVolumeClaim.claimName=c",
     "cache.volume must hold one volume source, got [hostPath persistentVolumeClaim]"),
    ("decode.drainGraceSeconds=115",
     "decode.terminationGracePeriodSeconds (120) must be at least decode.drainGraceSeconds + 20 (135)"),
    ("router.localPrefill.maxTokens=256", "router.localPrefill needs router.policy kv_events"),
    ("router.policy=joint", "router.policy must be one of the following"),
    ("decode.tp=0", "decode.tp: Must be greater than or equal to 1"),
], ids=["variant", "typo", "port", "policy", "two-volumes", "drain-beyond-termination-grace",
        "local-prefill-without-kv-events", "pair-policy", "tp-zero"])
def test_bad_values_are_rejected_with_a_clear_error(bad, message):
    proc = subprocess.run([_helm(), "template", "hm", str(CHART), "--set", bad], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_cache_volume_is_one_source():
    def cache(docs):
        vols = _by(docs, "Deployment", "hm-halfmoon-decode")["spec"]["template"]["spec"]["volumes"]
        return next(v for v in vols if v["name"] == "cache")
    assert cache(_render()) == {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}}
    assert cache(_render("-f", str(GPU_VALUES))) == {
        "name": "cache", "persistentVolumeClaim": {"claimName": "halfmoon-models", "readOnly": False}}


def test_router_policy_values_reach_its_args():
    def router_args(*flags):
        d = _by(_render(*flags), "Deployment", "hm-halfmoon-router")
        return d["spec"]["template"]["spec"]["containers"][0]["args"]
    default = router_args()
    assert default[default.index("--policy") + 1] == "per_role" and "--local-prefill-max-tokens" not in default
    assert default[default.index("--migration-limit") + 1] == "3"
    gpu = router_args("-f", str(GPU_VALUES))
    assert gpu[gpu.index("--policy") + 1] == "kv_events"
    assert gpu[gpu.index("--local-prefill-max-tokens") + 1] == "256"


def test_model_max_context_reaches_router_and_workers():
    """model.maxContext N: `--max-context N` on the router and both worker roles; 0 (default): none."""
    def args_of(docs, component):
        return _by(docs, "Deployment", f"hm-halfmoon-{component}")["spec"]["template"]["spec"]["containers"][0]["args"]
    capped = _render("--set", "model.maxContext=1024")
    for component in ("router", "prefill", "decode"):
        a = args_of(capped, component)
        assert a[a.index("--max-context") + 1] == "1024", component
        assert "--max-context" not in args_of(_render(), component)

"""The metric catalog (telemetry/metrics.py) as Prometheus sees it: naming lint, one owner per metric.

Each role's /metrics endpoint is served by start_metrics_server on a free loopback port, fetched
over HTTP and linted with `promtool check metrics` (Prometheus naming conventions).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from telemetry import metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def served():
    """role -> exposition text, one metrics server per role (stopped afterwards)."""
    ports = []
    try:
        texts = {}
        for role in metrics.ROLES:
            ports.append(metrics.start_metrics_server(0, role=role, worker_id=f"{role}-0", model="m"))
            assert ports[-1] > 0
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[-1]}/metrics", timeout=10) as resp:
                texts[role] = resp.read().decode()
        yield texts
    finally:
        for port in ports:  # only ours: other in-process services may serve metrics too
            metrics.stop_metrics_servers(port)


def _families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (halfmoon_\w+) ", text, flags=re.M))


def test_promtool_lint_passes(served):
    promtool = shutil.which("promtool") or pytest.fail("promtool missing: run `make tools`")
    for role, text in served.items():
        proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, f"{role}: {proc.stdout}{proc.stderr}"


def test_each_metric_has_exactly_one_owner(served):
    seen: dict[str, str] = {}
    for role, text in served.items():
        info = re.findall(r'^halfmoon_worker_info\{(.*)\} 1\.0$', text, flags=re.M)
        assert len(info) == 1 and f'role="{role}"' in info[0] and f'worker_id="{role}-0"' in info[0]
        for family in _families(text) - {"halfmoon_worker_info"}:
            assert family not in seen, f"{family} exported by {seen[family]} and {role}"
            seen[family] = role
            owner = family.split("_")[1]
            assert owner in metrics.GROUPS_BY_ROLE[role], f"{family} served by {role}"
    catalog = {m._name + ("_total" if m._type == "counter" else "")
               for group in metrics.METRICS_BY_GROUP.values() for m in group}
    assert set(seen) == catalog
    assert {f.split("_")[1] for f in _families(served["prefill"])} == {"prefill", "transfer", "worker"}


def test_known_label_values_exist_before_the_first_event():
    """A fresh process (other tests in this one count real events into the same counters) serves
    every known label value at 0 before anything happened."""
    code = ("import urllib.request; from telemetry import metrics; "
            "port = metrics.start_metrics_server(0, role='prefill', worker_id='prefill-0', model='m'); "
            "print(urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=10).read().decode())")
    text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          check=True, cwd=ROOT).stdout
    for reason in metrics.TRANSFER_FAILURE_REASONS:
        assert f'halfmoon_transfer_failures_total{{reason="{reason}"}} 0.0' in text
    for queue in metrics.PREFILL_QUEUES:
        assert f'halfmoon_prefill_queue_requests{{queue="{queue}"}}' in text


def test_bad_role_or_group_is_rejected():
    with pytest.raises(ValueError, match="role must be one of"):
        metrics.build_registry("scheduler")
    with pytest.raises(ValueError, match="unknown metric group"):
        metrics.build_registry(groups=["router", "kv"])


def test_stopping_one_server_leaves_the_others():
    a = metrics.start_metrics_server(0, role="router")
    b = metrics.start_metrics_server(0, role="decode")
    try:
        metrics.stop_metrics_servers(a)
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{a}/metrics", timeout=5)
        with urllib.request.urlopen(f"http://127.0.0.1:{b}/metrics", timeout=5) as resp:
            assert b"halfmoon_decode_running_requests" in resp.read()
    finally:
        metrics.stop_metrics_servers(a)
        metrics.stop_metrics_servers(b)

"""Prometheus rules (deploy/prometheus/rules.yaml): `promtool check rules` and `promtool test rules`.

promtool is Debian's `prometheus` package, installed by `make tools` (scripts/install-tools.sh).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool missing: run `make tools` (Debian package prometheus)")
    return exe


def _promtool_run(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_check_rules():
    proc = _promtool_run("check", "rules", "rules.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = sum(len(g["rules"]) for g in yaml.safe_load((PROM_DIR / "rules.yaml").read_text())["groups"])
    assert f"SUCCESS: {n} rules found" in proc.stdout


def test_local_prometheus_config_is_valid():
    proc = _promtool_run("check", "config", "prometheus-local.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rule_unit_tests():
    proc = _promtool_run("test", "rules", "rules_test.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_case():
    rules = yaml.safe_load((PROM_DIR / "rules.yaml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert {"HalfmoonWorkerDown", "HalfmoonHighTTFT", "HalfmoonTransferFailures",
            "HalfmoonKVPoolExhausted"} <= alerts
    tests = yaml.safe_load((PROM_DIR / "rules_test.yaml").read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if c["exp_alerts"]}
    quiet = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if not c["exp_alerts"]}
    assert alerts <= firing, f"alerts without a firing test case: {alerts - firing}"
    assert alerts <= quiet, f"alerts without a not-firing test case: {alerts - quiet}"


def test_rule_unit_tests_can_fail(tmp_path):
    """A wrong expectation makes `promtool test rules` fail (the test above is not vacuous)."""
    tests = yaml.safe_load((PROM_DIR / "rules_test.yaml").read_text())
    case = tests["tests"][0]["promql_expr_test"][0]
    case["exp_samples"][0]["value"] = 11
    shutil.copy(PROM_DIR / "rules.yaml", tmp_path / "rules.yaml")
    (tmp_path / "rules_test.yaml").write_text(yaml.safe_dump(tests))
    proc = _promtool_run("test", "rules", "rules_test.yaml", cwd=tmp_path)
    assert proc.returncode != 0 and "FAILED" in proc.stdout + proc.stderr

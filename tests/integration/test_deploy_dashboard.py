"""The Grafana dashboard (deploy/grafana/halfmoon-dashboard.json): generated, typed, valid PromQL.

- the committed JSON (and the chart's copy) equal deploy/grafana/build_dashboard.py's output;
- `tsc --strict` accepts it as @grafana/schema's Dashboard, each panel's options as its plugin's
  Options and each target as a Prometheus query (deploy/grafana/dashboard_types.ts; tools/node);
- every expression parses (promtool, as recording rules) and names only metrics of the catalog
  (telemetry/metrics.py) or recording rules of deploy/prometheus/rules.yaml; every catalog metric is
  on the dashboard. That expressions return series from a live stack: test_prometheus_live.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from telemetry import metrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "halfmoon-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
NODE_MODULES = ROOT / "tools" / "node" / "node_modules"


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row"
            for t in p["targets"]]


def _catalog_series_names() -> set[str]:
    names = set()
    for family in metrics.build_registry().collect():
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return {n for n in names if n.startswith("halfmoon_")}


def _recording_rules() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["record"] for g in groups for r in g["rules"] if "record" in r}


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_json_is_the_generated_one():
    text = _load_builder().render()
    assert DASHBOARD.read_text() == text, "run `python deploy/grafana/build_dashboard.py`"
    chart_copy = ROOT / "deploy" / "k8s" / "halfmoon" / "files" / "halfmoon-dashboard.json"
    assert chart_copy.read_text() == text, "run `python deploy/grafana/build_dashboard.py`"


def test_panels_are_well_formed():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Overview", "Front door", "Prefill", "Transfer", "Decode", "KV cache", "Workers"]
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}"
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def _write_ts_check(dashboard: dict, path: Path) -> None:
    lines = ["import type { DashboardJson, PromQueries, PanelOptions } from './dashboard_types';",
             f"export const dashboard = {json.dumps(dashboard)} satisfies DashboardJson;"]
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        lines.append(f"export const options_{p['id']} = {json.dumps(p['options'])}"
                     f" satisfies PanelOptions[{json.dumps(p['type'])}];")
        lines.append(f"export const targets_{p['id']} = {json.dumps(p['targets'])} satisfies PromQueries;")
    path.write_text("\n".join(lines) + "\n")


def test_typescript_accepts_the_dashboard_and_rejects_a_broken_one(tmp_path):
    """One `tsc` run over two files: the dashboard (no error) and a broken copy (errors expected)."""
    tsc = NODE_MODULES / "typescript" / "bin" / "tsc"
    if not (tsc.exists() and (NODE_MODULES / "@grafana" / "schema").exists()):
        pytest.fail(f"{NODE_MODULES}: typescript/@grafana/schema missing: run `make tools`")
    good = json.loads(DASHBOARD.read_text())
    broken = json.loads(DASHBOARD.read_text())
    broken["panels"][1]["targets"][0]["exprr"] = broken["panels"][1]["targets"][0].pop("expr")
    broken["panels"][1]["options"]["legend"]["placement"] = "middle"
    os.symlink(NODE_MODULES, tmp_path / "node_modules")
    shutil.copy(GRAFANA / "dashboard_types.ts", tmp_path / "dashboard_types.ts")
    _write_ts_check(good, tmp_path / "dashboard.ts")
    _write_ts_check(broken, tmp_path / "broken.ts")
    (tmp_path / "tsconfig.json").write_text(json.dumps({
        "compilerOptions": {"strict": True, "noEmit": True, "module": "esnext", "moduleResolution": "bundler",
                            "target": "es2022", "skipLibCheck": True, "types": []},
        "files": ["dashboard.ts", "broken.ts"]}))
    proc = subprocess.run(["node", str(tsc), "-p", "tsconfig.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stdout.splitlines() if re.match(r"^\S+\.ts\(\d+,\d+\): error", line)]
    assert not [e for e in errors if not e.startswith("broken.ts(")], proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exprr" in proc.stdout and '"middle"' in proc.stdout, proc.stdout


def test_expressions_parse_and_name_known_metrics(tmp_path):
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]}]}
    (tmp_path / "dashboard_rules.yaml").write_text(yaml.safe_dump(rules))
    promtool = shutil.which("promtool") or pytest.fail("promtool missing: run `make tools`")
    proc = subprocess.run([promtool, "check", "rules", "dashboard_rules.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    known = _catalog_series_names() | _recording_rules() | {"up"}
    used = set()
    for title, expr in queries:
        names = set(re.findall(r"\b(halfmoon[_:][a-z0-9_:]+|up)\b(?!\s*\()", expr))
        assert names, f"{title}: {expr} names no metric"
        assert names <= known, f"{title}: unknown metric(s) {names - known}"
        used |= names
    # every catalog metric is visible: on the dashboard directly or through a recording rule
    rule_exprs = " ".join(r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"])
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in _catalog_series_names()}
    unseen = {f for f in families if f not in " ".join(used) and f not in rule_exprs}
    assert not unseen, f"catalog metrics on no panel: {sorted(unseen)}"

"""Every Grafana panel query returns series from a real Prometheus scraping a running halfmoon stack.

The stack is `halfmoon up` (registry, 1 prefill, 1 decode, router; real model, loopback, free ports);
Prometheus is Debian's server (`make tools`) with deploy/prometheus/rules.yaml loaded, scraping
every /metrics endpoint each second under the job names the Helm chart's ServiceMonitor gives
(`halfmoon-<role>`). After real OpenAI-client traffic (prompts sharing a long prefix, sent twice so
the radix caches hit), each expression of deploy/grafana/halfmoon-dashboard.json goes through
/api/v1/query and must return at least one series; the panels that measure traffic must also show
a positive value, and every rule must evaluate without error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "halfmoon-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
LOCAL_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus-local.yml"

# Panels whose every query must show a finite value > 0 once traffic has flowed.
MUST_BE_POSITIVE = {
    "Requests per second by status", "Time to first token", "Inter-token latency", "End-to-end latency",
    "Tokens per second", "Prefill tokens per second", "Prefill batch size", "Prefill batch tokens",
    "Prefill compute busy fraction", "Prefill forward time", "KV transfer throughput",
    "KV pages transferred", "Transfer batch latency", "Generated tokens per second", "KV wait",
    "Decode KV pages by state", "Prefix cache hit rate", "Registered workers",
    "halfmoon processes by role and version", "Scrape targets up",
}

PREFIX = ("You are a careful assistant for a railway company. Answer in one short sentence, name the "
          "station and the platform, and never invent timetables. The network has three lines: the "
          "red line runs north to south, the blue line east to west, and the green line circles the "
          "old town; all of them meet at Central Station. Question: ")
QUESTIONS = ["Where does the red line stop?", "Which line circles the old town?",
             "Where do all lines meet?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"<{exc}>"


def _stop(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: started with start_new_session
            proc.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A running `halfmoon up`; yields its endpoints JSON."""
    tmp = tmp_path_factory.mktemp("stack")
    ep_file, log_dir = tmp / "endpoints.json", tmp / "logs"
    out = open(tmp / "up.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "halfmoon", "up", "--prefill", "1", "--decode", "1", "--base-port", "0",
         "--kv-memory-mb", "64", "--endpoints-file", str(ep_file), "--log-dir", str(log_dir),
         "--ready-timeout", "240", "--stop-timeout", "5",
         "--local-prefill-max-tokens", "0"],  # every prompt through P: the transfer panels must have data
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 270
        while not (ep_file.exists() and ep_file.stat().st_size):
            if proc.poll() is not None or time.monotonic() > deadline:
                children = "\n".join(f"--- {p.name}\n{_tail(p, 20)}" for p in sorted(log_dir.glob("*.log")))
                pytest.fail(f"`halfmoon up` did not come up (rc={proc.poll()}):\n{_tail(tmp / 'up.log')}\n{children}")
            time.sleep(0.5)
        time.sleep(0.2)  # the file is written in one call; let it land
        endpoints = json.loads(ep_file.read_text())
        endpoints["_log_dir"] = log_dir
        yield endpoints
    finally:
        _stop(proc, grace=45)
        out.close()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    """Debian's Prometheus scraping the stack every second with the repo's rules; yields its URL."""
    exe = shutil.which("prometheus") or pytest.fail("prometheus missing: run `make tools`")
    tmp = tmp_path_factory.mktemp("prometheus")
    targets = {"router": [stack["router"]["metrics"]], "registry": [stack["registry"]["metrics"]],
               "prefill": [w["metrics"] for w in stack["prefill"]],
               "decode": [w["metrics"] for w in stack["decode"]]}
    # The repo's example config, with the stack's actual ports and a 1 s cadence.
    config = yaml.safe_load(LOCAL_CONFIG.read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {f"halfmoon-{role}" for role in targets}
    for role, addrs in targets.items():
        jobs[f"halfmoon-{role}"]["static_configs"] = [{"targets": addrs}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [exe, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                active = _get_json(f"{url}/api/v1/targets")["data"]["activeTargets"]
                if len(active) == 4 and all(t["health"] == "up" for t in active):
                    break
            except OSError:
                active = []
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prometheus targets not up: {active}\n{_tail(tmp / 'prometheus.log')}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc, grace=15)
        log.close()


def _send_traffic(stack) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{stack['router']['http']}/v1", api_key=stack.get("api_key") or "unused", timeout=120)

    def one(question: str) -> int:
        stream = client.completions.create(model=stack["model"], prompt=PREFIX + question, max_tokens=8,
                                           temperature=0, stream=True)
        return sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)

    with ThreadPoolExecutor(max_workers=len(QUESTIONS)) as pool:
        for _ in range(2):  # the second pass hits the prefill and decode radix caches
            assert all(n > 0 for n in pool.map(one, QUESTIONS))


def _query(url: str, expr: str) -> list[dict]:
    data = _get_json(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert data["status"] == "success", data
    return data["data"]["result"]


def _positive(series: list[dict]) -> bool:
    values = [float(s["value"][1]) for s in series]
    return any(math.isfinite(v) and v > 0 for v in values)


def test_every_dashboard_query_returns_series(stack, prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]
    titles = {title for title, _ in queries}
    assert MUST_BE_POSITIVE <= titles, MUST_BE_POSITIVE - titles

    _send_traffic(stack)

    # Scrapes and rule evaluations run every second: poll until every query is satisfied.
    deadline = time.monotonic() + 45
    while True:
        missing = {}
        for title, expr in queries:
            series = _query(prometheus, expr)
            if not series:
                missing[f"{title}: {expr}"] = "no series"
            elif title in MUST_BE_POSITIVE and not _positive(series):
                missing[f"{title}: {expr}"] = [s["value"][1] for s in series]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    logs = "\n".join(f"--- {p.name}\n{_tail(p, 15)}" for p in sorted(Path(stack["_log_dir"]).glob("*.log")))
    assert not missing, f"{len(missing)}/{len(queries)} dashboard queries unsatisfied: " \
                        f"{json.dumps(missing, indent=1)}\n{logs}"

    # Every recording and alerting rule evaluates cleanly against the live series.
    groups = _get_json(f"{prometheus}/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    n_rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert len(rules) == n_rules
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    # Each role's worker_info is scraped under its job.
    info = _query(prometheus, "halfmoon_worker_info")
    assert {(s["metric"]["job"], s["metric"]["role"]) for s in info} == {
        (f"halfmoon-{r}", r) for r in ("router", "registry", "prefill", "decode")}



def test_live_expositions_lint_clean(stack):
    """The real services' /metrics pass `promtool check metrics` and export only their own groups."""
    from telemetry import metrics

    promtool = shutil.which("promtool") or pytest.fail("promtool missing: run `make tools`")
    addrs = {"router": stack["router"]["metrics"], "registry": stack["registry"]["metrics"],
             "prefill": stack["prefill"][0]["metrics"], "decode": stack["decode"][0]["metrics"]}
    for role, addr in addrs.items():
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=30)
        assert proc.returncode == 0, f"{role}: {proc.stdout}{proc.stderr}"
        owners = {line.split()[2].split("_")[1] for line in text.splitlines()
                  if line.startswith("# TYPE halfmoon_") and not line.startswith("# TYPE halfmoon_worker_info")}
        assert owners == set(metrics.GROUPS_BY_ROLE[role]), (role, owners)

def test_worker_down_alert_goes_pending(stack, prometheus):
    """SIGKILL the decode worker: its target goes down and HalfmoonWorkerDown turns pending for it
    (it fires after its `for: 1m`, which promtool's rules_test.yaml covers)."""
    decode = stack["decode"][0]
    os.kill(decode["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        alerts = _get_json(f"{prometheus}/api/v1/alerts")["data"]["alerts"]
        down = [a for a in alerts if a["labels"]["alertname"] == "HalfmoonWorkerDown"]
        if down or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [(a["labels"]["job"], a["labels"]["instance"], a["state"]) for a in down] == [
        ("halfmoon-decode", decode["metrics"], "pending")]

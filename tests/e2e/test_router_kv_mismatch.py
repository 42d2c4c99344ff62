"""A prefill and a decode worker whose KV pools differ (here ``--kv-layout``) can never move pages
between them. The router learns each worker's pool from the registry and does not send a request to
such a pair: the client gets HTTP 503 at once, naming the flag, and no worker is asked (the router
counts no retry)."""

from __future__ import annotations

import re
import time

import httpx

from tests.e2e.conftest import running_stack


def test_mismatched_pools_are_never_paired(tmp_path):
    role_args = {"prefill": ["--kv-layout", "page_major"], "decode": ["--kv-layout", "layer_major"]}
    with running_stack(tmp_path, 1, 1, role_args=role_args) as st:
        http = f"http://{st.endpoints['router']['http']}"
        t0 = time.monotonic()
        r = httpx.post(f"{http}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {st.endpoints['api_key']}"}, json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
        took = time.monotonic() - t0
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "--kv-layout" in msg and "page_major" in msg and "layer_major" in msg, msg
        assert took < 10, took
        metrics = httpx.get(f"http://{st.endpoints['router']['metrics']}/metrics", timeout=10).text
        retries = [float(v) for v in re.findall(r"^halfmoon_router_retries_total\{[^}]*\} (\S+)$", metrics, re.M)]
        assert sum(retries) == 0, retries

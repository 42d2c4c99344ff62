"""Endpoints file reader: router address, OpenAI URL, metrics URLs in the layouts `halfmoon up` may write."""

import json

import pytest

from bench import endpoints


def test_flat_layout():
    ep = endpoints.parse({"router_grpc": "127.0.0.1:5000", "openai_url": "http://127.0.0.1:8000/v1",
                          "metrics": ["127.0.0.1:9001", "http://127.0.0.1:9002/metrics"]})
    assert ep.router == "127.0.0.1:5000"
    assert ep.openai_url == "http://127.0.0.1:8000/v1"
    assert ep.metrics_urls == ["http://127.0.0.1:9001/metrics", "http://127.0.0.1:9002/metrics"]


def test_nested_per_role_layout():
    doc = {"router": {"grpc": "127.0.0.1:5000", "http": "http://127.0.0.1:8000", "metrics_port": 9000},
           "prefill": [{"grpc": "127.0.0.1:5001", "metrics_url": "http://127.0.0.1:9001/metrics"}],
           "decode": [{"grpc": "127.0.0.1:5002", "metrics": "127.0.0.1:9002"},
                      {"grpc": "127.0.0.1:5003", "metrics": "127.0.0.1:9002"}]}
    ep = endpoints.parse(doc)
    assert ep.router == "127.0.0.1:5000"
    assert ep.openai_url == "http://127.0.0.1:8000/v1"
    assert ep.metrics_urls == ["http://127.0.0.1:9000/metrics", "http://127.0.0.1:9001/metrics",
                               "http://127.0.0.1:9002/metrics"]


def test_load_file_or_log_with_a_json_line(tmp_path):
    f = tmp_path / "up.log"
    f.write_text("starting...\nrouter ready\n" + json.dumps({"router": "127.0.0.1:7"}) + "\n")
    assert endpoints.load(f).router == "127.0.0.1:7"
    g = tmp_path / "none.txt"
    g.write_text("nothing here\n")
    with pytest.raises(ValueError, match="no JSON"):
        endpoints.load(g)

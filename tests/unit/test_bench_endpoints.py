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


def test_halfmoon_up_layout(tmp_path):
    """The ENDPOINTS line `halfmoon up` prints (halfmoon/launcher.py), as captured from a real run."""
    line = ('ENDPOINTS {"router": {"grpc": "127.0.0.1:43509", "http": "127.0.0.1:44893", "metrics": '
            '"127.0.0.1:45039", "pid": 17337}, "registry": {"grpc": "127.0.0.1:39073", "metrics": "127.0.0.1:42741", '
            '"pid": 17292}, "prefill": [{"worker_id": "prefill-0", "grpc": "127.0.0.1:40499", "metrics": '
            '"127.0.0.1:32927", "pid": 17335}], "decode": [{"worker_id": "decode-0", "grpc": "127.0.0.1:37415", '
            '"metrics": "127.0.0.1:43179", "pid": 17336}], "model": "smollm2-135m-instruct", "log_dir": "/tmp/x", '
            '"torch_threads": 1}')
    f = tmp_path / "up.log"
    f.write_text("halfmoon is up\n  router gRPC 127.0.0.1:43509\n" + line + "\n")
    ep = endpoints.load(f)
    assert ep.router == "127.0.0.1:43509"
    assert ep.openai_url == "http://127.0.0.1:44893/v1"
    assert ep.metrics_urls == [f"http://127.0.0.1:{p}/metrics" for p in (45039, 42741, 32927, 43179)]


def test_api_key_and_cluster_credentials_from_up_json(tmp_path):
    from security import OPEN

    doc = {"router": {"grpc": "127.0.0.1:5000"}, "api_key": "hm-key", "auth": "token", "cluster_token": "c" * 32}
    ep = endpoints.parse(doc)
    assert ep.api_key == "hm-key" and "hm-key" not in repr(ep)
    assert endpoints.cluster_credentials(doc).token == "c" * 32
    assert endpoints.parse({"router": "127.0.0.1:5000"}).api_key is None
    assert endpoints.cluster_credentials({"auth": "open"}) == OPEN
    from security.certs import write_dev_certs

    c = write_dev_certs(tmp_path, ["client"])["client"]
    creds = endpoints.cluster_credentials({"tls": {"ca": str(c.ca), "cert": str(c.cert), "key": str(c.key)}})
    assert creds.mode == "mtls"

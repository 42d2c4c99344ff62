"""`halfmoon eval` against a live 1P1D stack: accuracy above the floor, pass 2 identical and cheaper."""

import json

import pytest

from bench import gsm8k
from halfmoon import cli
from tests.e2e import bench_live

# A hung stack fails in minutes, not at the suite-wide 600 s (stack start-up included on first use).
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def endpoints():
    yield str(bench_live.endpoints_file())
    bench_live.stop()


def test_arith_two_passes_same_tokens_fewer_pages(endpoints, tmp_path):
    out = tmp_path / "arith.json"
    rc = cli.main(["eval", "arith", "--endpoints", endpoints, "--request-timeout", "120", "--num-questions", "8",
                   "--concurrency", "2", "--max-tokens", "16", "--passes", "2", "--no-progress", "--output", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    p1, p2 = res["passes"]
    assert p1["errors"] == 0 and p2["errors"] == 0, (p1["error_examples"], p2["error_examples"])
    assert p1["correct"] >= 2                       # smoke floor: the default model gets ~half right
    assert p2["vs_pass_1"]["unit"] == "tokens" and p2["vs_pass_1"]["compared"] == 8
    assert p2["vs_pass_1"]["differing"] == 0, p2["vs_pass_1"]["diffs"]
    assert p2["accuracy"] == p1["accuracy"]
    u1, u2 = p1["usage"], p2["usage"]
    assert u1["completion_tokens"] > 0 and u1["prompt_tokens"] == u2["prompt_tokens"]
    assert u2["cached_tokens"] > u1["cached_tokens"]
    assert u1["kv_pages_transferred"] > 0 and u2["kv_pages_transferred"] < u1["kv_pages_transferred"]
    assert p1["metrics"]["kv"]["kv_pages_transferred"] == u1["kv_pages_transferred"]
    assert p2["metrics"]["kv"]["kv_pages_transferred"] == u2["kv_pages_transferred"]
    assert all(q["outputs"][0] == q["outputs"][1] for q in res["questions"])
    bench_live.assert_idle()


def test_gsm8k_few_questions(endpoints, tmp_path):
    try:
        gsm8k.load("test")
    except gsm8k.DataNotFoundError as e:
        pytest.skip(f"GSM8K data not present: {e}")
    out = tmp_path / "gsm8k.json"
    rc = cli.main(["eval", "gsm8k", "--endpoints", endpoints, "--request-timeout", "120", "--num-questions", "2",
                   "--num-shots", "1", "--max-tokens", "24", "--concurrency", "2", "--no-progress",
                   "--output", str(out)])
    assert rc == 0
    (p,) = json.loads(out.read_text())["passes"]
    assert p["questions"] == 2 and p["errors"] == 0
    assert p["usage"]["completion_tokens"] > 0 and p["usage"]["prompt_tokens"] > 2 * 100
    assert p["metrics"]["kv"]["kv_pages_transferred"] > 0
    bench_live.assert_idle()

"""`halfmoon bench serve` against a live 1P1D stack: the JSON is filled from real measurements.

Few requests, short outputs (the whole file runs in well under a minute once the stack is up).
"""

import json

import pytest

from halfmoon import cli
from tests.e2e import bench_live

# A hung stack fails in minutes, not at the suite-wide 600 s (stack start-up included on first use).
pytestmark = pytest.mark.timeout(300)

PAGE = 16          # halfmoon up's default page size (tokens)
PREFIX, SUFFIX = 3 * PAGE, PAGE


@pytest.fixture(scope="module")
def endpoints():
    yield str(bench_live.endpoints_file())
    bench_live.stop()


def _serve(endpoints, tmp_path, *extra):
    out = tmp_path / "result.json"
    rc = cli.main(["bench", "serve", "--endpoints", endpoints, "--request-timeout", "120", "--warmup", "0",
                   "--no-progress", "--output", str(out), *extra])
    return rc, json.loads(out.read_text())


def _summary(rc, res, n):
    """The run's summary, once the run exited 0 and its ``n`` requests all completed without error."""
    assert rc == 0
    s = res["summary"]
    assert (s["completed"], s["errors"]) == (n, 0), s["error_examples"]
    return s


@pytest.fixture(scope="module")
def shared_prefix_run(endpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared_prefix")
    png = tmp / "plot.png"
    rc, res = _serve(endpoints, tmp, "--workload", "shared-prefix", "--num-requests", "6", "--groups", "2",
                     "--prefix-len", str(PREFIX), "--suffix-len", str(SUFFIX), "--output-len", "6",
                     "--concurrency", "1", "--seed", "11", "--slo-ttft-ms", "120000", "--plot", str(png))
    return rc, res, png


def test_shared_prefix_over_grpc_moves_pages_only_for_the_uncached_delta(shared_prefix_run):
    """2 groups x 3 requests, one at a time: each group's first request moves its whole prompt
    (4 pages), the next two find the 3-page prefix in the decode radix cache and move 1 page."""
    rc, res, png = shared_prefix_run
    s = _summary(rc, res, 6)
    assert s["tokens"]["input"] == 6 * (PREFIX + SUFFIX)            # token ids sent as-is
    assert s["tokens"]["output"] == 6 * 6                          # ignore_eos: exact lengths
    assert s["ttft_ms"]["n"] == 6 and s["ttft_ms"]["min"] > 0
    assert s["itl_ms"]["n"] == 6 * 5 and s["itl_ms"]["min"] > 0
    assert s["tpot_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["ttft_ms"]["p99"]
    assert s["output_tokens_per_s"] > 0 and s["request_throughput"] > 0
    assert s["goodput"]["good"] == 6
    per_req = sorted(r["kv_pages_transferred"] for r in res["requests"])
    assert per_req == [1, 1, 1, 1, 4, 4], per_req
    assert s["tokens"]["decode_prefix"] == 4 * PREFIX
    kv = res["metrics"]["kv"]
    assert kv["kv_pages_transferred"] == s["kv_usage"]["pages_transferred"] == 12
    assert kv["decode_prefix_hit_tokens"] == 4 * PREFIX
    assert kv["transfer_failures"] == 0
    assert sum(b["output_tokens_per_s"] for b in res["timeline"]) > 0
    assert png.stat().st_size > 10_000
    bench_live.assert_idle()


def test_transfer_bytes_metric_matches_the_usage(shared_prefix_run):
    """The sender's byte counter (/metrics) and the per-request usage agree: each counted once."""
    rc, res, _ = shared_prefix_run
    assert rc == 0
    usage_bytes = res["summary"]["kv_usage"]["bytes_transferred"]
    assert usage_bytes > 0
    assert res["metrics"]["kv"]["kv_bytes_transferred"] == usage_bytes


def test_openai_target_through_the_routers_http_api(endpoints, tmp_path):
    rc, res = _serve(endpoints, tmp_path, "--target", "openai", "--workload", "random", "--num-requests", "3",
                     "--input-len", "32", "--output-len", "5", "--concurrency", "2", "--seed", "13")
    s = _summary(rc, res, 3)
    assert s["tokens"]["input"] == 3 * 32 and s["tokens"]["output"] == 3 * 5   # from the stream's usage
    assert s["ttft_ms"]["min"] > 0 and s["tpot_ms"]["n"] == 3
    assert res["config"]["endpoint"].startswith("http://") and res["config"]["model"]
    bench_live.assert_idle()


def test_multi_turn_conversations_grow_and_hit_the_cache(endpoints, tmp_path):
    rc, res = _serve(endpoints, tmp_path, "--workload", "multi-turn", "--num-requests", "4", "--turns", "2",
                     "--user-len", "20", "--output-len", "4", "--concurrency", "2", "--seed", "14")
    s = _summary(rc, res, 4)
    by_turn = {}
    for r in res["requests"]:
        by_turn.setdefault(r["session_id"], {})[r["turn"]] = r
    for turns in by_turn.values():
        assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + 20   # history + reply + new message
    assert s["tokens"]["cached"] > 0
    bench_live.assert_idle()

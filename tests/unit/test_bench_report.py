"""Summary and comparison tables; router request mapping; CLI wiring."""

import pytest

from bench import report, stats
from bench.request import BenchRequest, RequestRecord
from bench.router_target import to_proto


def result(out_tps, ttft_s, label):
    recs = [RequestRecord(start=0.0, chunk_times=[ttft_s, ttft_s + 0.1], chunk_tokens=[1, 1], end=ttft_s + 0.1,
                          ok=True, prompt_tokens=10, completion_tokens=2)]
    s = stats.summarize(recs, duration_s=2 / out_tps, slo=stats.SLO(ttft_ms=500))
    return {"config": {"target": "router", "endpoint": "x:1", "workload": "random", "load": "concurrency 1",
                       "label": label}, "summary": s, "metrics": None}


def test_summary_table_shows_the_headline_figures():
    text = report.summary_table(result(10.0, 0.2, "a"))
    assert "Output token throughput (tok/s):" in text and "10.00" in text
    assert "P99 TTFT" in text and "200.00" in text
    assert "Goodput (req/s) [SLO ttft_ms<=500]" in text


def test_compare_table_ratios_favour_the_first_when_above_one():
    text = report.compare_table([result(20.0, 0.1, "ours"), result(10.0, 0.4, "peer")], ["ours", "peer"])
    rows = {line.split()[0] + " " + line.split()[1]: line.split() for line in text.splitlines()[2:]}
    assert rows["output tok/s"][-1] == "2.00"      # 20 / 10
    assert rows["TTFT p50"][-1] == "4.00"          # 400 ms / 100 ms
    with pytest.raises(ValueError):
        report.compare_table([result(1.0, 0.1, "x")], ["x"])


def test_router_request_mapping_prefers_chat_then_ids_then_text():
    chat = to_proto(BenchRequest(prompt="p", prompt_ids=[1], messages=[{"role": "user", "content": "hi"}],
                                 max_tokens=7, ignore_eos=True, stop=["\n\n"]))
    assert chat.WhichOneof("input") == "chat" and chat.chat.messages[0].content == "hi"
    assert chat.sampling.max_tokens == 7 and chat.sampling.ignore_eos and list(chat.sampling.stop) == ["\n\n"]
    assert chat.sampling.HasField("temperature") and chat.sampling.temperature == 0.0
    ids = to_proto(BenchRequest(prompt="p", prompt_ids=[5, 6]))
    assert ids.WhichOneof("input") == "token_ids" and list(ids.token_ids.ids) == [5, 6]
    assert to_proto(BenchRequest(prompt="p")).text == "p"
    with pytest.raises(ValueError):
        to_proto(BenchRequest())


def test_cli_table_reaches_bench_and_eval():
    from halfmoon import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serve", "--num-requests", "0"])
    assert "--num-requests" in str(e.value)
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "arith", "--passes", "0"])
    assert "--passes" in str(e.value)

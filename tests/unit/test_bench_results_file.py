"""bench/results_file.py: where the decode benches write their JSON result."""

import json
import re

from bench import results_file


def test_output_path_wins_and_the_json_round_trips(tmp_path, capsys):
    out = results_file.write_result({"a": [1, 2.5], "b": "x"}, "decode_host", str(tmp_path / "r.json"))
    assert out == tmp_path / "r.json"
    assert json.loads(out.read_text()) == {"a": [1, 2.5], "b": "x"}
    assert capsys.readouterr().out == f"wrote {out}\n"


def test_default_is_the_results_dir_named_after_the_tool_and_the_time(tmp_path, monkeypatch):
    monkeypatch.setattr(results_file, "RESULTS_DIR", tmp_path)
    out = results_file.write_result({"k": 1}, "decode_memory")
    assert out.parent == tmp_path
    assert re.fullmatch(r"decode_memory_\d{8}T\d{6}\.json", out.name), out.name
    assert json.loads(out.read_text()) == {"k": 1}

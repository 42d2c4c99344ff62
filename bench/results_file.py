"""Where a bench tool writes its JSON result: ``--output``, else ``bench/results/<name>_<time>.json``;
or (the CPU benches) on stdout and, with ``--json``, to that file too."""

from __future__ import annotations

import json
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"


def write_result(result: dict, name: str, output: str = "") -> Path:
    """Write ``result`` as indented JSON to ``output`` (a path) or, when empty, to
    ``bench/results/<name>_<YYYYmmddTHHMMSS>.json`` (local time); prints ``wrote <path>`` and
    returns the path. Raises OSError when the file cannot be written."""
    out = Path(output or RESULTS_DIR / f"{name}_{time.strftime('%Y%m%dT%H%M%S')}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return out


def print_result(result: dict, path: str | None = None) -> None:
    """Print ``result`` as JSON (indent 2) on stdout and, when ``path`` is given, write the same text
    there. Raises OSError when the file cannot be written."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")

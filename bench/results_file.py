"""Where a bench tool writes its JSON result: ``--output``, else ``bench/results/<name>_<time>.json``."""

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

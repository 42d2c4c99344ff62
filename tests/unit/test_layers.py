"""Import layers (docs/architecture.md, "Layers"): every import of every module of every package,
at module level or inside a function, read with ``ast`` and checked against the rules.

  ground      protos/, telemetry/, security/ import no project package but protos
  library     engine/                        imports ground only: no service, pd_common, bench, halfmoon
  PD/transfer transfer_svc/                  ground + engine
              pd_common/                     ground + engine + transfer_svc (worker start-up opens the
                                             transfer engine and the registry client); transfer_svc
                                             never imports pd_common
  services    prefill_svc/, decode_svc/,     ground + engine + transfer_svc + pd_common; never each
              router_svc/                    other (they talk over gRPC), nor bench or halfmoon
  tools       bench/                         the above, but of a service package (pd_common,
                                             transfer_svc, *_svc) only its top-level public API
  top         halfmoon/                      anything
Nothing imports ``tests``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GROUND = {"protos", "telemetry", "security"}
SERVICE_PACKAGES = {"pd_common", "transfer_svc", "prefill_svc", "decode_svc", "router_svc"}
# package -> the other project packages it may import (itself is always allowed)
ALLOWED = {
    "protos": set(),
    "telemetry": {"protos"},
    "security": {"protos"},
    "engine": GROUND,
    "transfer_svc": GROUND | {"engine"},
    "pd_common": GROUND | {"engine", "transfer_svc"},
    "prefill_svc": GROUND | {"engine", "transfer_svc", "pd_common"},
    "decode_svc": GROUND | {"engine", "transfer_svc", "pd_common"},
    "router_svc": GROUND | {"engine", "transfer_svc", "pd_common"},
    "bench": GROUND | {"engine"} | SERVICE_PACKAGES,  # services: top level only (test below)
    "halfmoon": GROUND | {"engine", "bench"} | SERVICE_PACKAGES,
}
PROJECT = set(ALLOWED) | {"tests"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for each import in ``source`` (the module ``module``), anywhere in
    it. ``from pkg import name`` counts as importing ``pkg.name`` when that is a module or package
    of the project; ``importlib.import_module("literal")`` counts too."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                rel = Path(ROOT, *sub.split("."))
                found.append((node.lineno, sub if rel.with_suffix(".py").is_file() or rel.is_dir() else base))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append((node.lineno, node.args[0].value))
    return found


def project_imports(package: str):
    """(file:line, imported module) for every project import in ``package``."""
    for path in sorted((ROOT / package).rglob("*.py")):
        found = imports_of(path.read_text(), module_name(path), path.name == "__init__.py")
        for line, name in dict.fromkeys(found):  # one entry per line and module
            if name.split(".")[0] in PROJECT:
                yield f"{path.relative_to(ROOT)}:{line}", name


def test_every_package_has_a_rule():
    text = (ROOT / "pyproject.toml").read_text()
    include = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include\s*=\s*\[([^\]]*)\]", text).group(1)
    assert {p.strip().strip('"').rstrip("*") for p in include.split(",") if p.strip()} == set(ALLOWED)


def test_scanner_sees_every_kind_of_import():
    src = ("import engine.config\nfrom protos import common_pb2\nfrom . import errors\n"
           "from ..kvcache import radix_cache\nfrom transfer_svc import TransferEngine\n"
           "def f():\n    from decode_svc.scheduler import DecodeScheduler\n"
           "    importlib.import_module('bench.serve')\n")
    got = [n for _, n in imports_of(src, "engine.attention.base", is_package=False)]
    assert got == ["engine.config", "protos.common_pb2", "engine.attention", "engine.kvcache.radix_cache",
                   "transfer_svc", "decode_svc.scheduler", "bench.serve"]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layer_rules(package):
    allowed = ALLOWED[package] | {package}
    bad = [f"{where}: imports {name} ({package} may import only: {', '.join(sorted(allowed))})"
           for where, name in project_imports(package) if name.split(".")[0] not in allowed]
    assert not bad, "\n".join(bad)


def test_bench_uses_only_the_public_api_of_services():
    """bench may use ``transfer_svc`` (its ``__init__`` exports), never ``transfer_svc.<module>``."""
    bad = [f"{where}: imports {name} (use the package's top-level API: from {name.split('.')[0]} import ...)"
           for where, name in project_imports("bench")
           if name.split(".")[0] in SERVICE_PACKAGES and "." in name]
    assert not bad, "\n".join(bad)

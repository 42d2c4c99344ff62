"""transfer_svc's engine modules: the public API, the names other packages import from
transfer_svc.engine, and the layer order (a module imports only modules below it)."""

from __future__ import annotations

import ast
import pathlib

import transfer_svc
from transfer_svc import engine

# lowest first; each may import only those before it
LAYERS = ["ucp", "digest", "types", "liveness", "progress", "memory", "inbox", "segments",
          "batches", "inflight", "transfers", "engine"]
PKG = pathlib.Path(transfer_svc.__file__).parent


def _imported_layers(module: str) -> set[str]:
    tree = ast.parse((PKG / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "transfer_svc":
                found.update(a.name for a in node.names)
            elif node.module.startswith("transfer_svc."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names
                         if a.name.startswith("transfer_svc."))
    return found & set(LAYERS)


def test_modules_import_only_lower_layers():
    for i, module in enumerate(LAYERS):
        higher = _imported_layers(module) - set(LAYERS[:i])
        assert not higher, f"transfer_svc/{module}.py imports higher layers {sorted(higher)}"


def test_public_api_and_engine_module_agree():
    public = ["TransferEngine", "Op", "State", "BatchStatus", "Notify", "Region", "Segment",
              "TransferError", "SegmentClosed", "DescriptorError", "BoundsError", "UCXError"]
    assert sorted(transfer_svc.__all__) == sorted(public)
    for name in public:
        assert getattr(engine, name) is getattr(transfer_svc, name), name
    # imported from transfer_svc.engine by the services (decode_svc/peers.py, ...)
    for name in ("host_id", "pid_start_ticks", "NOTIFY_AM_ID"):
        assert hasattr(engine, name), name


def test_engine_public_methods_are_kept():
    methods = {"register_memory", "unregister_memory", "regions", "publish", "open_segment",
               "close_segment", "segments", "submit", "status", "wait", "release", "send_notify",
               "poll_notifies", "wait_notify", "close", "__enter__", "__exit__"}
    assert methods <= set(dir(engine.TransferEngine))

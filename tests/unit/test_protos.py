"""The committed gRPC stubs match the .proto sources (regenerate with `make protos`)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh():
    proc = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_service_is_importable():
    from protos import decode_pb2_grpc, prefill_pb2_grpc, registry_pb2_grpc, router_pb2_grpc

    for mod, name in [(decode_pb2_grpc, "Decode"), (prefill_pb2_grpc, "Prefill"),
                      (registry_pb2_grpc, "Registry"), (router_pb2_grpc, "Router")]:
        assert hasattr(mod, f"{name}Servicer") and hasattr(mod, f"{name}Stub")


def test_the_freshness_check_ignores_only_the_grpc_tools_version_stamp(tmp_path):
    # a grpcio-tools patch release (1.85.1 -> 1.85.4) rewrote only this line in every stub and
    # turned the check red on a fresh install with no proto changed
    from protos.generate import _same

    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text("import grpc\nGRPC_GENERATED_VERSION = '1.85.1'\nclass DecodeStub: pass\n")
    b.write_text("import grpc\nGRPC_GENERATED_VERSION = '1.85.4'\nclass DecodeStub: pass\n")
    c.write_text("import grpc\nGRPC_GENERATED_VERSION = '1.85.1'\nclass PrefillStub: pass\n")
    assert _same(a, b)
    assert not _same(a, c)
    assert not _same(a, tmp_path / "missing.py")

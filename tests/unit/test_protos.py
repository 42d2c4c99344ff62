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

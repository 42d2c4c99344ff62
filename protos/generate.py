"""Regenerate the committed gRPC stubs: ``python -m protos.generate`` (or ``make protos``).

Writes ``protos/*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` from ``protos/*.proto`` with
``grpc_tools.protoc``. ``--check`` regenerates into a temporary folder and exits 1 when the
committed stubs differ (the test suite runs it).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(p.relative_to(ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_root / "protos").glob("*_pb2*.py*"))


# grpc_tools stamps its own version into each *_pb2_grpc.py (the stub refuses a grpcio older than
# it at import); a newer grpcio-tools patch release changes only that line, which is not a change of
# the protos, so the freshness check compares the files without it
_STAMP = re.compile(rb"^GRPC_GENERATED_VERSION = .*$", re.M)


def _same(a: Path, b: Path) -> bool:
    return b.exists() and _STAMP.sub(b"", a.read_bytes()) == _STAMP.sub(b"", b.read_bytes())


def main(argv: list[str]) -> int:
    check = "--check" in argv
    with tempfile.TemporaryDirectory() as tmp:
        produced = generate(Path(tmp))
        stale = [p.name for p in produced if not _same(p, PROTO_DIR / p.name)]
        if check:
            if stale:
                print("stale generated stubs (run `make protos`):", ", ".join(stale))
                return 1
            print("generated stubs are up to date")
            return 0
        for p in produced:
            shutil.copyfile(p, PROTO_DIR / p.name)
        print(f"wrote {len(produced)} files into {PROTO_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

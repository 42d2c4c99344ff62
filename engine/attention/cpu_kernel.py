"""The CPU paged decode-attention kernel (``csrc/paged_decode.cpp``): built once per machine, loaded
by every process.

Build: ``python -m engine.attention.cpu_kernel`` (``make kernels``, which ``make install`` runs)
compiles the source with ``torch.utils.cpp_extension.load`` (g++, ninja, ``-O3 -march=native
-fopenmp``) into ``$HALFMOON_HOME/kernels/paged_decode_<key>/``. ``<key>`` hashes the source, the
flags, torch's and Python's versions and this CPU's model and flags, so an edited source, another
torch or another machine sharing the home directory gets its own build, never a stale or
wrong-ISA one. Builds racing in several processes are serialised by torch's lock file in that
directory; a ``built`` marker is written (atomically) only after the module imports, so a reader
never loads a half-linked library.

Load: :func:`load` never compiles (a worker must not spend a minute in g++ at startup, nor a test
its timeout): it imports the built module or returns the reason it cannot, once per process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

from engine.model_store import halfmoon_home

log = logging.getLogger("halfmoon.engine.attention")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]
BUILD_HINT = "build it once per machine: `make kernels` or `python -m engine.attention.cpu_kernel`"

_loaded: tuple[ModuleType | None, str] | None = None


def _cpu_id() -> str:
    """This CPU's model name and ISA flags (what ``-march=native`` compiled for)."""
    keep = ("model name", "flags")
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.split(":")[0].strip() in keep]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build_key() -> str:
    """12 hex digits over the source, flags, torch/Python versions and the CPU."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 sys.version.encode(), _cpu_id().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """``$HALFMOON_HOME/kernels/paged_decode_<key>``."""
    return halfmoon_home() / "kernels" / f"paged_decode_{build_key()}"


def module_name() -> str:
    return f"halfmoon_paged_decode_{build_key()}"


def build(verbose: bool = False) -> Path:
    """Compile (or find up to date) and import the kernel; returns its build directory.

    Raises whatever the compiler or import raises (``RuntimeError`` / ``subprocess`` errors from
    torch.utils.cpp_extension, ``OSError``) with g++'s output when ``verbose``.
    """
    from torch.utils import cpp_extension

    d = build_dir()
    d.mkdir(parents=True, exist_ok=True)
    # a pip-installed ninja sits next to this interpreter, which need not be on PATH (unactivated venv)
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # copies: load() appends to the lists it is given, which would change build_key()
    cpp_extension.load(module_name(), [str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                       build_directory=str(d), verbose=verbose)
    tmp = d / f"built.{os.getpid()}"
    tmp.write_text(torch.__version__ + "\n")
    os.replace(tmp, d / "built")
    return d


def load() -> tuple[ModuleType | None, str]:
    """(module, "") when the kernel is built for this machine, else (None, why) — never builds.

    The module has ``paged_decode(q, k_pages, v_pages, page_table, seq_lens, scale, out, splits)``
    (csrc/paged_decode.cpp states the shapes and dtypes). Cached per process.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if os.environ.get("HALFMOON_CPU_KERNEL", "") == "off":
        _loaded = (None, "HALFMOON_CPU_KERNEL=off")
        return _loaded
    d = build_dir()
    so = d / f"{module_name()}.so"
    if not (d / "built").exists() or not so.exists():
        _loaded = (None, f"not built for this machine and source ({d} missing); {BUILD_HINT}")
        return _loaded
    try:
        spec = importlib.util.spec_from_file_location(module_name(), so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:  # a broken build must not take a worker down: the caller decides
        _loaded = (None, f"{so} failed to import: {e}; {BUILD_HINT}")
        return _loaded
    _loaded = (mod, "")
    return _loaded


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.attention.cpu_kernel", description=__doc__.splitlines()[0])
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = p.parse_args(argv)
    d = build(verbose=args.verbose)
    global _loaded
    _loaded = None
    mod, why = load()
    if mod is None:
        print(f"error: built in {d} but {why}", file=sys.stderr)
        return 1
    print(f"paged decode kernel built: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

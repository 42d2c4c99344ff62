"""The engine's C++ CPU kernels: built once per machine, loaded by every process.

Three kernels, each its own torch extension (:data:`KERNELS`):

* ``paged_decode`` (``attention/csrc/paged_decode.cpp``): decode attention reading the KV pool in
  place (``engine.attention.cpu_paged_backend``);
* ``small_gemm`` (``models/csrc/small_gemm.cpp``): float32 ``x @ W.T`` for the few rows of a decode
  step, weights packed once (``engine.models.cpu_linear.PackedLinear``);
* ``decode_glue`` (``models/csrc/decode_glue.cpp``): residual add + RMSNorm, RoPE in place and
  SiLU·mul between those GEMMs, one call each (``engine.torch_fused_ops``).

Build: ``python -m engine.cpu_kernels`` (``make kernels``, a prerequisite of ``make test`` and
``make demo``) compiles each source with ``torch.utils.cpp_extension.load`` (g++, ninja, ``-O3
-march=native -fopenmp``) into ``$HALFMOON_HOME/kernels/<name>_<key>/``. ``<key>`` hashes the
source, the flags, torch's and Python's versions and this CPU's model and flags, so an edited
source, another torch or another machine sharing the home directory gets its own build, never a
stale or wrong-ISA one. Builds racing in several processes are serialised by torch's lock file in
that directory; a ``built`` marker is written (atomically) only after the module imports, so a
reader never loads a half-linked library.

Load: :meth:`CpuKernel.load` never compiles (a worker must not spend a minute in g++ at startup,
nor a test its timeout): it imports the built module or returns the reason it cannot, once per
process. ``HALFMOON_CPU_KERNEL=off`` turns every kernel off (the callers' torch fallbacks run).
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

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]
BUILD_HINT = "build it once per machine: `make kernels` or `python -m engine.cpu_kernels`"


def _cpuinfo(keys: tuple[str, ...]) -> list[str] | None:
    """The distinct /proc/cpuinfo lines of those keys, sorted (one per key on a uniform CPU); None
    when the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return sorted({ln for ln in f if ln.split(":")[0].strip() in keys})
    except OSError:
        return None


def cflags() -> list[str]:
    """``CFLAGS`` plus this CPU's software-prefetch hint for ``small_gemm``'s weight stream:
    non-temporal (locality 0) on AMD, where it was tuned (the 2-core Zen boxes), T0 (locality 3)
    elsewhere: on the Intel Xeon (Sapphire Rapids class) test box ``prefetchnta`` capped the stream
    at 5-6 GB/s of weights against 14-26 GB/s with ``prefetcht0`` (a 3072 x 576 layer at M=1: 1.20 ->
    0.28 ms; bench/README.md, "Intel Xeon box")."""
    amd = any("AuthenticAMD" in ln for ln in _cpuinfo(("vendor_id",)) or ())
    return CFLAGS + [f"-DHALFMOON_PREFETCH_LOCALITY={0 if amd else 3}"]


def _cpu_id() -> str:
    """This CPU's vendor, model name and ISA flags (what ``-march=native`` and :func:`cflags` compiled for)."""
    lines = _cpuinfo(("vendor_id", "model name", "flags"))
    return platform.processor() if lines is None else "".join(lines)


class CpuKernel:
    """One C++ source built as one torch extension; see the module docstring.

    Args:
        name: the extension's name stem (``paged_decode``).
        source: its ``.cpp`` file.
        extra_cflags: flags after :func:`cflags` (a later flag wins: ``-ffp-contract=off``).
    """

    def __init__(self, name: str, source: Path, extra_cflags: tuple[str, ...] = ()):
        self.name = name
        self.source = source
        self.extra_cflags = list(extra_cflags)
        self._loaded: tuple[ModuleType | None, str] | None = None
        self._said_why = False

    def cflags(self) -> list[str]:
        return cflags() + self.extra_cflags

    def build_key(self) -> str:
        """12 hex digits over the source, flags, torch/Python versions and the CPU."""
        h = hashlib.sha256()
        for part in (self.source.read_bytes(), " ".join(self.cflags() + LDFLAGS).encode(), torch.__version__.encode(),
                     sys.version.encode(), _cpu_id().encode()):
            h.update(part)
            h.update(b"\0")
        return h.hexdigest()[:12]

    def build_dir(self) -> Path:
        """``$HALFMOON_HOME/kernels/<name>_<key>``."""
        return halfmoon_home() / "kernels" / f"{self.name}_{self.build_key()}"

    def module_name(self) -> str:
        return f"halfmoon_{self.name}_{self.build_key()}"

    def build(self, verbose: bool = False) -> Path:
        """Compile (or find up to date) and import the kernel; returns its build directory.

        Raises whatever the compiler or import raises (``RuntimeError`` / ``subprocess`` errors from
        torch.utils.cpp_extension, ``OSError``) with g++'s output when ``verbose``.
        """
        from torch.utils import cpp_extension

        d = self.build_dir()
        d.mkdir(parents=True, exist_ok=True)
        # a pip-installed ninja sits next to this interpreter, which need not be on PATH (unactivated venv)
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # copies: load() appends to the lists it is given, which would change build_key()
        cpp_extension.load(self.module_name(), [str(self.source)], extra_cflags=self.cflags(),
                           extra_ldflags=list(LDFLAGS), build_directory=str(d), verbose=verbose)
        tmp = d / f"built.{os.getpid()}"
        tmp.write_text(torch.__version__ + "\n")
        os.replace(tmp, d / "built")
        self._loaded = None
        return d

    def load(self) -> tuple[ModuleType | None, str]:
        """(module, "") when the kernel is built for this machine, else (None, why) — never builds.
        Cached per process."""
        if self._loaded is not None:
            return self._loaded
        if os.environ.get("HALFMOON_CPU_KERNEL", "") == "off":
            self._loaded = (None, "HALFMOON_CPU_KERNEL=off")
            return self._loaded
        d = self.build_dir()
        so = d / f"{self.module_name()}.so"
        if not (d / "built").exists() or not so.exists():
            self._loaded = (None, f"not built for this machine and source ({d} missing); {BUILD_HINT}")
            return self._loaded
        try:
            spec = importlib.util.spec_from_file_location(self.module_name(), so)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except Exception as e:  # a broken build must not take a worker down: the caller decides
            self._loaded = (None, f"{so} failed to import: {e}; {BUILD_HINT}")
            return self._loaded
        self._loaded = (mod, "")
        return self._loaded

    def load_or_say_why(self, log: logging.Logger, instead: str) -> ModuleType | None:
        """:meth:`load`'s module, or None after logging (once per process) ``"<instead>: <why>"``,
        ``instead`` saying what runs in the kernel's place."""
        mod, why = self.load()
        if mod is None and not self._said_why:
            self._said_why = True
            log.info("%s: %s", instead, why)
        return mod


_HERE = Path(__file__).parent
PAGED_DECODE = CpuKernel("paged_decode", _HERE / "attention" / "csrc" / "paged_decode.cpp")
SMALL_GEMM = CpuKernel("small_gemm", _HERE / "models" / "csrc" / "small_gemm.cpp")
# no FMA contraction: its RoPE must round each product as torch does
DECODE_GLUE = CpuKernel("decode_glue", _HERE / "models" / "csrc" / "decode_glue.cpp", ("-ffp-contract=off",))
KERNELS = (PAGED_DECODE, SMALL_GEMM, DECODE_GLUE)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine.cpu_kernels", description=__doc__.splitlines()[0])
    p.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = p.parse_args(argv)
    for k in KERNELS:
        d = k.build(verbose=args.verbose)
        mod, why = k.load()
        if mod is None:
            print(f"error: {k.name} built in {d} but {why}", file=sys.stderr)
            return 1
        print(f"{k.name} kernel built: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

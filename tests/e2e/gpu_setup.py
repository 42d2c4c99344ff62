"""What tests/e2e/test_gpu_services.py runs on and compares with: the devices, dtype and model
directory (``HALFMOON_GPU_TEST_DEVICES``, ``HALFMOON_GPU_TEST_DTYPE``, ``HALFMOON_GPU_MODEL_DIR``: see
that module's docstring), its requests (:class:`Case`) and their reference, the co-located engine's
output of each in module order (:func:`colocated`).
"""

from __future__ import annotations

import gc
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import ROOT, model_available

MAX_TOKENS = 16
PAGE = 16
CHUNK = 512          # --chunked-prefill-size of P and of the reference: same chunks, same arithmetic
SHARED = 544         # tokens the second long prompt shares with the first (34 pages)
LONG = 600
SEED = 1234
TEMPERATURE = 0.5    # exact in float32 (the proto's type), so P, D and the reference divide by the same
LOGPROB_TOL = 1e-4   # see tests/e2e/test_gpu_services.py's docstring


@dataclass
class Setup:
    prefill_device: str
    decode_device: str
    dtype: str
    model_dir: Path

    @property
    def cuda(self) -> bool:
        return self.prefill_device.startswith("cuda")


@dataclass
class Case:
    """One request, in the order it is sent (and run by the reference)."""
    name: str
    ids: list[int]
    temperature: float = 0.0
    seed: int | None = None
    ref: list[int] = field(default_factory=list)
    ref_logprobs: list[float] = field(default_factory=list)

    def engine_params(self):
        from engine.sampling_params import SamplingParams

        return SamplingParams(max_tokens=MAX_TOKENS, temperature=self.temperature, seed=self.seed,
                              ignore_eos=True, logprobs=True)

    def problems(self, ids: list[int] | None, logprobs: list[float], via: str) -> list[str]:
        """What differs from the reference: the tokens (``ids``; None to skip), the logprobs (each
        within LOGPROB_TOL). Reported together, so one run shows both."""
        out = []
        if ids is not None and ids != self.ref:
            out.append(f"{self.name} via {via}: tokens {ids} != reference {self.ref}")
        if len(logprobs) != len(self.ref_logprobs):
            out.append(f"{self.name} via {via}: {len(logprobs)} logprobs, reference {len(self.ref_logprobs)}")
        else:
            worst = max(abs(a - b) for a, b in zip(logprobs, self.ref_logprobs))
            if worst > LOGPROB_TOL:
                out.append(f"{self.name} via {via}: logprobs differ from the reference by up to {worst:.3g}:"
                           f"\n   {logprobs}\n   {self.ref_logprobs}")
        return out


def devices() -> tuple[str, str]:
    env = os.environ.get("HALFMOON_GPU_TEST_DEVICES", "").strip()
    if env:
        devs = [d.strip() for d in env.split(",")]
        assert len(devs) == 2, f"HALFMOON_GPU_TEST_DEVICES={env!r}: want 'PREFILL_DEVICE,DECODE_DEVICE'"
        return devs[0], devs[1]
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (HALFMOON_GPU_TEST_DEVICES=cpu,cpu runs the mechanics on CPU)")
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")


def model_dir(tmp: Path) -> Path:
    env = os.environ.get("HALFMOON_GPU_MODEL_DIR", "").strip()
    if env:
        d = Path(env).resolve()
        assert (d / "config.json").is_file() and (d / "tokenizer.json").is_file(), \
            f"HALFMOON_GPU_MODEL_DIR={env}: no config.json + tokenizer.json there (scripts/make_gpu_model_dir.sh)"
        return d
    if not model_available():
        pytest.skip("no HALFMOON_GPU_MODEL_DIR and no local model cache to make one from "
                    "(scripts/make_gpu_model_dir.sh DEST on a machine with `halfmoon models pull`)")
    d = tmp / "model-smollm2-dummy"
    subprocess.run([str(ROOT / "scripts" / "make_gpu_model_dir.sh"), str(d)], check=True, cwd=ROOT)
    return d


def colocated(setup: Setup, cs: list[Case]) -> None:
    from engine.config import EngineConfig
    from engine.engine import Engine

    cfg = EngineConfig(model=str(setup.model_dir), load_format="dummy", dtype=setup.dtype,
                       device=setup.prefill_device, page_size=PAGE, num_pages=512,
                       max_running_requests=16,  # = D's rows (2 x --max-running-requests): same graph buckets
                       chunked_prefill_size=CHUNK, seed=0, torch_threads=None if setup.cuda else 1)
    eng = Engine(config=cfg)
    try:
        for c in cs:
            out = eng.generate([c.ids], c.engine_params())[0]
            c.ref, c.ref_logprobs = list(out.token_ids), list(out.logprobs)
            assert len(c.ref) == len(c.ref_logprobs) == MAX_TOKENS, c.name
    finally:
        del eng
        gc.collect()
        if setup.cuda:
            torch.cuda.empty_cache()

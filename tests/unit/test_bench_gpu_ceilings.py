"""The ceilings the GPU benchmark's floors divide by (``bench.gpu_ceilings``): the GPU model's nominal
figures, an explicit flag over them, and a model without figures measured rather than given the H200's
(an H100 run once got floors from the H200's 4.26 TB/s, 43 % above its own 2.98)."""

from __future__ import annotations

import pytest

from bench import gpu_ceilings
from bench.gpu_ceilings import floor_ceilings, nominal_ceilings


def test_each_gpu_model_gets_its_own_nominal_figures():
    assert nominal_ceilings("NVIDIA H200") == (4.26e12, 788e12)
    assert nominal_ceilings("NVIDIA H100 80GB HBM3") == (2.98e12, 780e12)
    assert nominal_ceilings("NVIDIA A100-SXM4-80GB") is None


@pytest.mark.parametrize("name,flags,expect,measured,earlier", [
    ("NVIDIA H100 80GB HBM3", (None, None), (2.98e12, 780e12), False, None),
    ("NVIDIA H100 80GB HBM3", (3.1e12, None), (3.1e12, 780e12), False, None),  # a flag wins over nominal
    ("NVIDIA A100-SXM4-80GB", (None, None), (1.7e12, 290e12), True, None),  # no nominal: this run's ceilings
    ("NVIDIA A100-SXM4-80GB", (1.5e12, 280e12), (1.5e12, 280e12), False, None),
    # ceilings measured earlier in the run are used, not measured again
    ("NVIDIA A100-SXM4-80GB", (None, None), (1.6e12, 300e12), False, {"copy_bw_Bps": 1.6e12, "gemm_flops": 300e12}),
])
def test_floor_ceilings(monkeypatch, name, flags, expect, measured, earlier):
    calls = []
    monkeypatch.setattr(gpu_ceilings.torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(gpu_ceilings, "ceilings",
                        lambda args: calls.append(1) or {"copy_bw_Bps": 1.7e12, "gemm_flops": 290e12})
    assert floor_ceilings(*flags, earlier) == expect
    assert bool(calls) == measured

"""Timing helpers of the GPU benchmark: CUDA-event timing of a callable, kernel times from a profile."""

from __future__ import annotations

import torch


def events_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """GPU milliseconds of each of ``iters`` calls of ``fn`` (CUDA events around each call), after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return out


def kernel_times(prof) -> dict[str, list[float]]:
    """CUDA kernels of a ``torch.profiler.profile``, by name (cut to 90 characters): [device µs, count]."""
    agg: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            a = agg.setdefault(ev.name[:90], [0.0, 0])
            a[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            a[1] += 1
    return agg


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """CUDA kernels of a profile as (start µs, end µs, name cut to 60 characters), by start."""
    return sorted((ev.time_range.start, ev.time_range.end, ev.name[:60]) for ev in prof.events()
                  if ev.device_type.name == "CUDA")


def merged_busy_us(ks: list[tuple[float, float, str]]) -> float:
    """Device-busy µs of ``kernel_intervals`` (overlapping kernels counted once)."""
    busy, cur_s, cur_e = 0.0, ks[0][0], ks[0][1]
    for s, e, _ in ks[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s

"""Local memory registered for RMA: ucp_mem_map'ed regions and their packed rkeys.

The region list is shared by caller threads (register, bounds checks of submit, publish) and the
progress thread (teardown); `lookup()` holds its lock across a whole batch's bounds checks.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import threading
from typing import Callable, Iterator

from transfer_svc import ucp
from transfer_svc.progress import ProgressThread
from transfer_svc.types import BoundsError, Region, find_range

LocalFinder = Callable[[int, int], Region]  # (addr, nbytes) -> the region holding them


def _cuda_context_current(location: str) -> None:
    """Make the device's primary CUDA context current in the calling (progress) thread: UCX's cuda
    transports query and copy CUDA memory through the thread's current context."""
    import torch

    torch.cuda.set_device(int(location.split(":", 1)[1]) if ":" in location else 0)


class LocalMemory:
    """The engine's registered regions, sorted by base, never overlapping."""

    def __init__(self, progress: ProgressThread):
        self._progress = progress
        self._regions: list[Region] = []
        self._bases: list[int] = []
        self._lock = threading.Lock()

    def register(self, ptr: int, length: int, location: str = "cpu") -> Region:
        """Register [ptr, ptr + length) bytes; location "cpu" or "cuda[:N]" (CUDA memory via
        UCS_MEMORY_TYPE_CUDA). Raises ValueError on bad arguments or an overlap with a registered
        region, UCXError if UCX refuses the mapping."""
        if not isinstance(ptr, int) or ptr <= 0:
            raise ValueError(f"ptr must be a positive address, got {ptr!r}")
        if not isinstance(length, int) or length <= 0:
            raise ValueError(f"length must be > 0 bytes, got {length!r}")
        if location == "cpu":
            mem_type = ucp.UCS_MEMORY_TYPE_HOST
        elif location == "cuda" or location.startswith("cuda:"):
            mem_type = ucp.UCS_MEMORY_TYPE_CUDA
        else:
            raise ValueError(f"location must be 'cpu' or 'cuda:N', got {location!r}")
        with self._lock:
            for r in self._regions:
                if ptr < r.base + r.length and r.base < ptr + length:
                    raise ValueError(f"[{ptr:#x}, +{length}) overlaps registered region "
                                     f"[{r.base:#x}, +{r.length})")
        region = self._progress.call(self._map, ptr, length, location, mem_type)
        with self._lock:
            i = bisect.bisect(self._bases, ptr)
            self._regions.insert(i, region)
            self._bases.insert(i, ptr)
        return region

    def _map(self, ptr: int, length: int, location: str, mem_type: int) -> Region:
        lib, ctx = self._progress.lib, self._progress.ctx
        if mem_type == ucp.UCS_MEMORY_TYPE_CUDA:
            _cuda_context_current(location)
        mp = ucp.ucp_mem_map_params_t()
        mp.field_mask = (ucp.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | ucp.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                         | ucp.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE)
        mp.address, mp.length, mp.memory_type = ptr, length, mem_type
        memh = ctypes.c_void_p()
        lib.check(lib.ucp_mem_map(ctx, ctypes.byref(mp), ctypes.byref(memh)), "ucp_mem_map")
        buf, blen = ctypes.c_void_p(), ctypes.c_size_t()
        st = lib.ucp_rkey_pack(ctx, memh, ctypes.byref(buf), ctypes.byref(blen))
        if st != ucp.UCS_OK:
            lib.ucp_mem_unmap(ctx, memh)
            lib.check(st, "ucp_rkey_pack")
        rkey = ctypes.string_at(buf, blen.value)
        lib.ucp_rkey_buffer_release(buf)
        return Region(ptr, length, location, memh.value, rkey)

    def unregister(self, region: Region) -> None:
        """Unmap a region; ValueError if it is not registered here."""
        with self._lock:
            if region not in self._regions:
                raise ValueError("region is not registered with this engine")
            i = self._regions.index(region)
            del self._regions[i]
            del self._bases[i]
        self._progress.call(self._progress.lib.ucp_mem_unmap, self._progress.ctx, region.memh)

    @contextlib.contextmanager
    def lookup(self) -> Iterator[LocalFinder]:
        """Hold the region list steady and yield find(addr, nbytes) -> Region, which raises
        BoundsError for a range outside every registered region."""
        with self._lock:
            yield self._find

    def _find(self, addr: int, n: int) -> Region:
        r = find_range(self._bases, self._regions, addr, n)
        if r is None:
            raise BoundsError(f"local range [{addr:#x}, +{n}) is outside every registered region")
        return r

    def regions(self) -> list[Region]:
        """A copy of the registered regions, by base."""
        with self._lock:
            return list(self._regions)

    def unmap_all(self) -> None:
        """Unmap every region (progress thread, at teardown)."""
        for r in self._regions:
            self._progress.lib.ucp_mem_unmap(self._progress.ctx, r.memh)
        self._regions.clear()
        self._bases.clear()

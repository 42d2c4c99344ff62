"""engine.kvcache.page_hash: chained page keys, identical across processes and PYTHONHASHSEED values."""

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kvcache.page_hash import ROOT_HASH, page_hash, page_hashes

ROOT = Path(__file__).resolve().parents[2]


def _ref(parent, page):
    body = struct.pack("<Q", parent) + b"".join(struct.pack("<q", t) for t in page)
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def test_matches_the_documented_formula():
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    hs = page_hashes(toks, 4)
    assert len(hs) == 2  # the partial last page has no hash
    h0 = _ref(ROOT_HASH, toks[:4])
    assert hs == [h0, _ref(h0, toks[4:8])]
    assert all(0 <= h < 2**64 for h in hs)


def test_chain_keys_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6], 2)
    b = page_hashes([1, 2, 9, 9, 5, 6], 2)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # same last page, different prefix
    assert page_hashes([1, 2, 3, 4], 2) == a[:2]  # prefix of a sequence -> prefix of its hashes
    assert page_hashes([1, 2, 3, 4], 2, seed=7) != a[:2]
    assert page_hashes([1, 2, 3, 4], 4) != page_hashes([1, 2, 3, 4], 2)[-1:]
    assert page_hashes([], 4) == [] and page_hashes([1, 2, 3], 4) == []


@pytest.mark.parametrize("bad", [dict(tokens=[1], page_size=0), dict(tokens=[-1], page_size=1),
                                 dict(tokens=[2**63], page_size=1)])
def test_bad_input_raises(bad):
    with pytest.raises(ValueError):
        page_hashes(**bad)
    with pytest.raises(ValueError):
        page_hash(-1, [1])


_CHILD = """
import json, torch
from engine.kvcache.page_hash import page_hashes
from engine.kvcache.radix_cache import RadixCache
toks = list(range(1000, 1037)) + [5] * 11
tree = RadixCache(4, lambda p: None, enable_events=True)
tree.insert(toks, torch.arange(len(toks), dtype=torch.int64) + 64)
tree.insert(toks[:20] + [7] * 8, torch.arange(28, dtype=torch.int64) + 256)
tree.evict(3)
ev = [[e.kind, list(e.page_hashes), e.parent_hash, e.token_start, e.token_end] for e in tree.drain_events()]
print(json.dumps({"ph": page_hashes(toks, 16), "events": ev, "salted": hash("abc")}))
"""


def test_keys_equal_across_processes_with_different_hash_seeds():
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        p = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        outs.append(json.loads(p.stdout))
    assert outs[0]["salted"] != outs[1]["salted"]  # the seeds really differ
    assert outs[0]["ph"] == outs[1]["ph"] and len(outs[0]["ph"]) == 3
    assert outs[0]["events"] == outs[1]["events"]
    kinds = [e[0] for e in outs[0]["events"]]
    assert kinds.count("insert") == 2 and "evict" in kinds
    # and they equal this process's keys
    toks = list(range(1000, 1037)) + [5] * 11
    assert outs[0]["ph"] == page_hashes(toks, 16)

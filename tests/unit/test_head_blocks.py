"""D's unblock (pd_common/head_blocks.py): a page written head-blocked (one contiguous
``[layers, 2, page_size, h, head_dim]`` block per head range, in head order, as P's per-rank writes
land) is rewritten exactly into the pool's token-major ``[layers, 2, page_size, heads, head_dim]``
page, other pages untouched; the notice's cuts are checked before anything changes. On CPU and, where
there is one, on a CUDA pool (64 pages a copy there: 100 pages are a full chunk and a partial one)."""

from __future__ import annotations

import pytest
import torch

from pd_common.head_blocks import HeadUnblocker, check_cuts, rank_blocks, unblock_pages
from tests.unit.devices import DEVICES

LAYERS, PS, HD = 3, 4, 5


def blocked(pages: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """What P's writes leave in D's pages: each page's head blocks, contiguous, in head order."""
    out, h = [], 0
    for n in sizes:
        out.append(pages[:, :, :, :, h:h + n].reshape(len(pages), -1))
        h += n
    return torch.cat(out, dim=1).view(pages.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[2, 1], [1, 2], [1, 1, 1], [3, 4, 1]])
def test_unblock_rebuilds_the_token_major_pages_exactly(device, dtype, sizes):
    torch.manual_seed(sum(sizes))
    heads, n_pages = sum(sizes), 150  # many copy chunks, the last one partial
    want = torch.randn(n_pages, LAYERS, 2, PS, heads, HD).to(dtype=dtype, device=device)
    pool = want.clone()
    pages = torch.randperm(n_pages)[:100].tolist()
    pool[pages] = blocked(want[pages], sizes)
    assert not torch.equal(pool, want)
    bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
    unblock_pages(pool, pages, list(zip(bounds[:-1], bounds[1:])))
    assert torch.equal(pool, want)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_cuts_and_bad_input(device):
    assert rank_blocks([0, 2, 3], 0, 3) == [(0, 2), (2, 3)]
    assert rank_blocks([0, 2, 3], 2, 3) == [(2, 3)]
    assert rank_blocks([0, 1, 2, 3], 0, 2) == [(0, 1), (1, 2)]
    assert check_cuts([], 3) is None and check_cuts([0, 2, 3], 3) is None
    for bad in ([0, 2], [1, 3], [0, 2, 2, 3], [0, 3, 2, 3]):
        assert "not increasing from 0 to 3" in check_cuts(bad, 3)
    pool = torch.zeros(4, LAYERS, 2, PS, 3, HD, device=device)
    with pytest.raises(ValueError, match="do not cover a pool of 3 kv heads"):
        unblock_pages(pool, [0], [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="outside a pool of 4 pages"):
        unblock_pages(pool, [4], [(0, 1), (1, 3)])


@pytest.mark.parametrize("device", DEVICES)
def test_the_unblocker_of_one_rank_refuses_bad_cuts_and_leaves_whole_pages_alone(device):
    torch.manual_seed(1)
    want = torch.randn(6, LAYERS, 2, PS, 3, HD).to(device)
    pool = want.clone()
    pool[[4, 1]] = blocked(want[[4, 1]], [2, 1])
    u = HeadUnblocker(pool, [(0, 3)], None, 3)
    snapshot = pool.clone()
    assert "not increasing" in u.unblock([4, 1], [0, 2])
    assert torch.equal(pool, snapshot)  # nothing changed on a refusal
    assert u.unblock([4, 1], []) == "" and torch.equal(pool, snapshot)  # no cuts: token-major already
    assert u.unblock([4, 1], [0, 2, 3]) == ""
    assert torch.equal(pool, want)

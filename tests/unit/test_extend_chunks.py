"""engine/extend_chunks.py: the next prompt chunks under a token budget and their EXTEND batch
(the loop P's chunked prefill, D's local prefill and D's resume share)."""

import pytest
import torch

from engine.extend_chunks import extend_batch, next_chunks
from engine.forward_batch import ForwardMode


def test_chunks_fill_the_budget_in_order_and_split_the_last_one():
    prompts = [list(range(10)), list(range(100, 108)), list(range(200, 205))]
    # request 0 has 6 of 10 computed: its 4 left, then 5 of request 1's 8; request 2 gets nothing
    assert next_chunks(prompts, [6, 0, 0], 9) == [[6, 7, 8, 9], [100, 101, 102, 103, 104]]
    # the rest of request 1 and all of request 2 fit
    assert next_chunks(prompts[1:], [5, 0], 100) == [[105, 106, 107], [200, 201, 202, 203, 204]]


def test_a_spent_budget_takes_nothing_and_an_exact_fit_stops_there():
    prompts = [[1, 2, 3], [4, 5]]
    assert next_chunks(prompts, [0, 0], 0) == []
    assert next_chunks(prompts, [0, 0], -1) == []
    assert next_chunks(prompts, [0, 0], 3) == [[1, 2, 3]]
    assert next_chunks([], [], 8) == []


def test_extend_batch_writes_each_chunk_into_its_own_rows_slots():
    # rows 0..2 of a req_to_token table whose slot ids say where they are: row r, position p -> 100r + p
    r2t = torch.tensor([[100 * r + p for p in range(16)] for r in range(3)], dtype=torch.int32)
    chunks = [[7, 8, 9], [5]]
    batch = extend_batch(r2t, [2, 0], [4, 11], chunks, "cpu")
    assert batch.mode is ForwardMode.EXTEND
    assert batch.out_cache_loc.tolist() == [204, 205, 206, 11]
    assert batch.out_cache_loc.dtype == torch.int64
    assert batch.input_ids.tolist() == [7, 8, 9, 5]
    assert batch.positions.tolist() == [4, 5, 6, 11]
    assert batch.prefix_lens.tolist() == [4, 11]
    assert batch.seq_lens.tolist() == [7, 12]
    assert batch.req_pool_indices.tolist() == [2, 0]


def test_extend_batch_refuses_no_request_and_an_empty_chunk():
    r2t = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="at least one request"):
        extend_batch(r2t, [], [], [], "cpu")
    with pytest.raises(ValueError, match="at least one new token"):
        extend_batch(r2t, [0, 1], [0, 8], [[1], []], "cpu")

"""The ModelRunner the GPU benchmark's 8B sections time: dummy weights, bf16, page 16, the rows
of a decode batch at one context length, and one prefill row."""

from __future__ import annotations

import time

import torch

PAGE_SIZE = 16


def build_runner(args, max_bs: int, max_context: int, num_pages: int, cuda_graph: bool = True, tp: int = 1):
    """(ModelRunner of ``args.model`` with dummy weights, seconds it took to build). ``tp`` > 1:
    tensor parallel over cuda:0..tp-1 (``num_pages`` per rank; ``close()`` it when done)."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    t = time.perf_counter()
    layout = {"kv_layout": args.kv_layout} if getattr(args, "kv_layout", None) else {}  # else the engine's
    r = ModelRunner(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                                 page_size=PAGE_SIZE, num_pages=num_pages, max_running_requests=max_bs,
                                 max_context=max_context, cuda_graph=cuda_graph, cuda_graph_max_bs=max_bs,
                                 chunked_prefill_size=1 << 20, tp_size=tp, **layout))
    torch.cuda.synchronize()
    return r, time.perf_counter() - t


def decode_rows(r, n: int, context: int) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` request rows, each with slots for ``context`` cached tokens and the one a decode step
    writes (slot ``context``): (rows, slots per row)."""
    rows = [r.req_to_token_pool.alloc() for _ in range(n)]
    slots = [r.allocator.alloc_slots(0, context + 1, None) for _ in range(n)]
    for row, s in zip(rows, slots):
        r.req_to_token_pool.write(row, 0, s)
    return rows, slots


def decode_batch(rows: list[int], slots: list[torch.Tensor], context: int, token_ids: list[int]):
    """A decode ForwardBatch of the first len(token_ids) rows at ``context``."""
    from engine.forward_batch import ForwardBatch, ForwardMode

    B = len(token_ids)
    return ForwardBatch.build(ForwardMode.DECODE, rows[:B], [context] * B, [[t] for t in token_ids],
                              torch.stack([s[context] for s in slots[:B]]), "cuda")


def prefill_row(r, T: int):
    """One request row with slots for ``T`` new tokens and seeded random ids: (row, ids, slots,
    the extend ForwardBatch of all ``T`` from position 0)."""
    from engine.forward_batch import ForwardBatch, ForwardMode

    row = r.req_to_token_pool.alloc()
    slots = r.allocator.alloc_slots(0, T, None)
    r.req_to_token_pool.write(row, 0, slots)
    ids = torch.randint(0, r.model_config.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    return row, ids, slots, ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [ids], slots, "cuda")

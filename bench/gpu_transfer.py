"""GPU -> GPU KV transfer between two processes (UCX cuda_ipc through transfer_svc) and P/D on two GPUs.

Called by ``python -m bench.gpu transfer pd`` (two GPUs; on one GPU both
sides use GPU 0, which checks the code but not the NVLink path).

transfer: an 8B-shaped request (32 layers, 8 KV heads x 128, bf16, page 16 -> 32 KiB per page per
  buffer, 64 buffers) of 4096 tokens (256 pages, 512 MiB), whole and delta (last 1024 tokens, 64
  pages, 128 MiB), from an engine KVPool on GPU 0 (this process) into one on GPU 1 (a spawned target
  process), three ways:
    per_layer  one put per (buffer, contiguous page run): contiguous destination pages (1 run) and
               scattered ones (every page its own run) -- the per-layer pool's cost
    staged     gather the pages of all 64 buffers into one staging buffer on GPU 0, one put into a
               staging buffer on GPU 1, scatter there into the pool pages (gather + put + scatter)
    (the pools here are layer_major on purpose: per_layer and staged are that layout's ways)
    page_major the same bytes as one contiguous region on each side (what a page-major pool
               [pages, layers, K/V, page_size, heads, dim] holds for a run of pages), sent as k puts
               of nbytes / k (k = 1, 4, 16, 64): the put-count cost without any per-layer split
  against a plain torch device-to-device peer copy of the same bytes (one contiguous copy_).
  Every way is verified: per-(buffer, page) checksums on GPU 1 equal those of the source pages.
  Timing: wall clock from the submit (after torch.cuda.synchronize on the source) to remote
  completion (flush); median of reps after a warm-up. ``--transfer-busy-poll`` makes the sending
  engine's progress thread poll without sleeping while a batch is in flight.

pd: a prefill worker (GPU 0, this process: ModelRunner + TransferEngine) and a decode worker (GPU 1,
  spawned: ModelRunner + TransferEngine, CUDA graphs) on Llama-3.1-8B-shaped dummy weights (same
  seed -> same weights). Per request: D allocates its row ([prefix slots | delta slots]) and sends
  the delta's destination pages; P prefills the whole prompt, samples the first token (greedy),
  synchronizes its stream, writes pages [pre_len/ps, ceil(n/ps)) as one put per run per buffer, waits
  for remote completion, then hands D the first token; D decodes the rest with greedy argmax.
  Request 2 shares request 1's first 512 tokens, which D reuses (delta only). Tokens are compared
  with the co-located Engine on GPU 0 (same weights, radix cache off so it prefills like P).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp

L, KVH, D, PS = 32, 8, 128, 16
PAGE_ELEMS = PS * KVH * D  # bf16 elements of one page of one buffer
PAGE_BYTES = PAGE_ELEMS * 2
POOL_PAGES = 1024


def devices() -> tuple[str, str]:
    """(P's device, D's device): GPU 0 and GPU 1, or GPU 0 twice on a one-GPU machine (a code check:
    cuda_ipc between two processes on one GPU, not the NVLink path)."""
    return ("cuda:0", "cuda:1") if torch.cuda.device_count() > 1 else ("cuda:0", "cuda:0")


def _checksums(bufs: list[torch.Tensor], pages: list[int]) -> list[int]:
    """One int64 per buffer: sum_i (i + 1) * sum(int16 view of page pages[i]) (order-sensitive)."""
    idx = torch.tensor(pages, device=bufs[0].device)
    w = torch.arange(1, len(pages) + 1, device=bufs[0].device, dtype=torch.int64)
    out = []
    for b in bufs:
        v = b.view(-1, PAGE_ELEMS)[idx].view(torch.int16).to(torch.int64).sum(-1)
        out.append(int((v * w).sum()))
    return out


def _engine(name: str, transports, busy_poll: bool = False):
    from transfer_svc import TransferEngine

    return TransferEngine(name, transports=transports, timeout_s=60, busy_poll=busy_poll)


# ----------------------------------------------------------------------------- transfer target
def _target(conn, transports, staging_bytes: int) -> None:
    dev = devices()[1]
    torch.cuda.set_device(dev)
    from engine.kvcache.kv_pool import KVPool

    pool = KVPool(POOL_PAGES, PS, L, KVH, D, torch.bfloat16, dev, layout="layer_major")
    bufs = pool.buffers()
    staging = torch.zeros(staging_bytes // 2, dtype=torch.bfloat16, device=dev)
    eng = _engine("gpu-target", transports)
    for b in bufs + [staging]:
        eng.register_memory(b.data_ptr(), b.numel() * b.element_size(), dev)
    torch.cuda.synchronize()
    conn.send((eng.publish().SerializeToString(), [b.data_ptr() for b in bufs], staging.data_ptr()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            break
        if cmd == "zero":
            for b in bufs:
                b.zero_()
            torch.cuda.synchronize()
            conn.send(True)
        elif cmd == "scatter":  # staging [64, n, PAGE_ELEMS] -> pool pages arg
            idx = torch.tensor(arg, device=dev)
            n = len(arg)
            st = staging[: 64 * n * PAGE_ELEMS].view(64, n, PAGE_ELEMS)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for i, b in enumerate(bufs):  # int64 views: 4x fewer, wider elements per index kernel
                b.view(torch.int64).view(-1, PAGE_ELEMS // 4).index_copy_(0, idx, st[i].view(torch.int64))
            e.record()
            e.synchronize()
            conn.send(s.elapsed_time(e))
        elif cmd == "checksums":
            conn.send(_checksums(bufs, arg))
        elif cmd == "staging_sum":  # int16 sum of the first arg bytes of the staging buffer
            conn.send(int(staging[: arg // 2].view(torch.int16).to(torch.int64).sum()))
    eng.close()


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merge page pairs into (src start, dst start, n pages) runs contiguous on both sides."""
    out: list[list[int]] = []
    for s, d in zip(src, dst):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += 1
        else:
            out.append([s, d, 1])
    return [tuple(r) for r in out]


def transfer(args) -> dict:
    src_dev, dst_dev = devices()
    from engine.kvcache.kv_pool import KVPool
    from protos import registry_pb2
    from transfer_svc import State

    transports = getattr(args, "transports", None)
    whole, delta = 256, 64
    staging_bytes = 64 * whole * PAGE_BYTES
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, transports, staging_bytes), daemon=True)
    proc.start()
    out: dict = {"shape": "llama-3.1-8b", "page_bytes": PAGE_BYTES, "buffers": 64, "transports": transports,
                 "devices": [src_dev, dst_dev]}
    try:
        pool = KVPool(POOL_PAGES, PS, L, KVH, D, torch.bfloat16, src_dev, layout="layer_major")
        bufs = pool.buffers()
        for b in bufs:
            b.normal_()
        staging = torch.zeros(staging_bytes // 2, dtype=torch.bfloat16, device=src_dev)
        busy = bool(getattr(args, "transfer_busy_poll", False))
        out["busy_poll"] = busy
        eng = _engine("gpu-source", transports, busy)
        for b in bufs + [staging]:
            eng.register_memory(b.data_ptr(), b.numel() * b.element_size(), src_dev)
        desc_bytes, dptrs, dstaging = parent.recv()
        desc = registry_pb2.SegmentDescriptor()
        desc.ParseFromString(desc_bytes)
        seg = eng.open_segment(desc)
        sptrs = [b.data_ptr() for b in bufs]
        g = torch.Generator().manual_seed(0)
        reps = args.transfer_reps

        def put(descs) -> float:
            torch.cuda.synchronize()  # queued writes to the source pages must land before UCX reads them
            t = time.perf_counter()
            st = eng.wait(eng.submit(seg, descs))
            dt = time.perf_counter() - t
            if st.state is not State.COMPLETED:
                raise RuntimeError(f"transfer failed: {st}")
            return dt * 1e3

        def verify(src_pages, dst_pages) -> bool:
            parent.send(("checksums", dst_pages))
            return parent.recv() == _checksums(bufs, src_pages)

        rows = []
        for what, n in (("whole", whole), ("delta", delta)):
            src = list(range(POOL_PAGES - n, POOL_PAGES))  # the request's pages on P
            nbytes = 64 * n * PAGE_BYTES
            # peer-copy ceiling: the same bytes as one contiguous device-to-device copy
            a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=src_dev).normal_()
            bdst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dst_dev)
            times = []
            for _ in range(reps + 1):
                torch.cuda.synchronize(src_dev)
                torch.cuda.synchronize(dst_dev)
                t = time.perf_counter()
                bdst.copy_(a)
                torch.cuda.synchronize(dst_dev)
                torch.cuda.synchronize(src_dev)
                times.append((time.perf_counter() - t) * 1e3)
            peer_ms = statistics.median(times[1:])
            del a, bdst
            rows.append({"case": what, "way": "torch_peer_copy", "bytes": nbytes, "puts": 1, "ms": peer_ms,
                         "GBps": nbytes / peer_ms / 1e6})
            for layout in ("contiguous", "scattered"):
                dst = (list(range(n)) if layout == "contiguous"
                       else [int(x) for x in torch.randperm(POOL_PAGES, generator=g)[:n]])
                runs = _runs(src, dst)
                descs = [(sp + s * PAGE_BYTES, dp + d * PAGE_BYTES, k * PAGE_BYTES)
                         for sp, dp in zip(sptrs, dptrs) for s, d, k in runs]
                parent.send(("zero", None))
                parent.recv()
                times = [put(descs) for _ in range(reps + 1)]
                ok = verify(src, dst)
                ms = statistics.median(times[1:])
                rows.append({"case": what, "way": f"per_layer_{layout}", "bytes": nbytes, "puts": len(descs),
                             "ms": ms, "GBps": nbytes / ms / 1e6, "frac_of_peer": peer_ms / ms, "verified": ok})
            # staged: gather (GPU0) -> one put -> scatter (GPU1), destination scattered
            dst = [int(x) for x in torch.randperm(POOL_PAGES, generator=g)[:n]]
            sidx = torch.tensor(src, device=src_dev)
            st_view = staging[: 64 * n * PAGE_ELEMS].view(64, n, PAGE_ELEMS)
            parent.send(("zero", None))
            parent.recv()
            tg, tp, ts, tw = [], [], [], []
            for _ in range(reps + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for i, b in enumerate(bufs):  # int64 views: 4x fewer, wider elements per index kernel
                    torch.index_select(b.view(torch.int64).view(-1, PAGE_ELEMS // 4), 0, sidx,
                                       out=st_view[i].view(torch.int64))
                e.record()
                e.synchronize()
                tg.append(s.elapsed_time(e))
                tp.append(put([(staging.data_ptr(), dstaging, nbytes)]))
                parent.send(("scatter", dst))
                ts.append(parent.recv())
                tw.append((time.perf_counter() - t0) * 1e3)
            ok = verify(src, dst)
            med = lambda x: statistics.median(x[1:])  # noqa: E731
            rows.append({"case": what, "way": "staged", "bytes": nbytes, "puts": 1, "gather_ms": med(tg),
                         "put_ms": med(tp), "scatter_ms": med(ts), "ms": med(tg) + med(tp) + med(ts),
                         "wall_ms": med(tw), "frac_of_peer": peer_ms / (med(tg) + med(tp) + med(ts)),
                         "verified": ok})
            # page-major: the request's pages are one contiguous region on each side
            verify_pm = torch.randint(0, 1 << 15, (nbytes // 2,), dtype=torch.int16, device=src_dev)
            staging[: nbytes // 2].view(torch.int16).copy_(verify_pm)
            torch.cuda.synchronize()
            for k in (1, 4, 16, 64):
                part = nbytes // k
                descs = [(staging.data_ptr() + i * part, dstaging + i * part, part) for i in range(k)]
                times = [put(descs) for _ in range(reps + 1)]
                parent.send(("staging_sum", nbytes))
                ok = parent.recv() == int(verify_pm.to(torch.int64).sum())
                ms = statistics.median(times[1:])
                rows.append({"case": what, "way": f"page_major_{k}_puts", "bytes": nbytes, "puts": k, "ms": ms,
                             "GBps": nbytes / ms / 1e6, "frac_of_peer": peer_ms / ms, "verified": ok})
            for r in rows[-8:]:
                print(r, flush=True)
        out["rows"] = rows
        eng.close()
    finally:
        parent.send(("exit", None))
        proc.join(30)
    return out


# ----------------------------------------------------------------------------- P/D on two GPUs
def _runner_cfg(device: str, max_context: int, num_pages: int, model: str = "llama-3.1-8b"):
    from engine.config import EngineConfig

    return EngineConfig(model=model, load_format="dummy", dtype="bfloat16", device=device,
                        page_size=PS, num_pages=num_pages, max_running_requests=8, max_context=max_context,
                        cuda_graph_max_bs=8, disable_radix_cache=True, seed=0)


def _decode_worker(conn, transports, max_context: int, num_pages: int, model: str) -> None:
    dev = devices()[1]
    torch.cuda.set_device(dev)
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.model_runner import ModelRunner

    r = ModelRunner(_runner_cfg(dev, max_context, num_pages, model))
    eng = _engine("decode-gpu1", transports)
    bufs = r.kv_pool.buffers()
    for b in bufs:
        eng.register_memory(b.data_ptr(), b.numel() * b.element_size(), dev)
    conn.send((eng.publish().SerializeToString(), [b.data_ptr() for b in bufs]))
    held: dict[int, tuple[int, torch.Tensor]] = {}  # request -> (row, slots) kept for prefix reuse
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        _, rid, n, pre_from, pre_len, max_tokens = msg
        row = r.req_to_token_pool.alloc()
        if pre_len:
            prow, pslots = held[pre_from]
            prefix = pslots[:pre_len]
            delta = r.allocator.alloc_slots(pre_len, n + max_tokens, int(prefix[-1]))
            slots = torch.cat([prefix, delta])
        else:
            slots = r.allocator.alloc_slots(0, n + max_tokens, None)
        r.req_to_token_pool.write(row, 0, slots)
        ps = r.page_size
        dst_pages = (slots[pre_len:n:ps] // ps).tolist()  # delta pages (pre_len is page-aligned)
        conn.send(("dst", dst_pages))
        _, first = conn.recv()  # after P's put completed remotely
        toks = [first]
        t0 = time.perf_counter()
        for pos in range(n, n + max_tokens - 1):
            b = ForwardBatch.build(ForwardMode.DECODE, [row], [pos], [[toks[-1]]], slots[pos:pos + 1], dev)
            toks.append(int(r.forward(b).argmax(-1)))
        conn.send(("tokens", toks, (time.perf_counter() - t0) / max(1, max_tokens - 1) * 1e3))
        held[rid] = (row, slots)
    eng.close()


def pd(args) -> dict:
    src_dev, dst_dev = devices()
    from engine.engine import Engine
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.model_runner import ModelRunner
    from engine.sampling_params import SamplingParams
    from protos import registry_pb2
    from transfer_svc import State

    transports = getattr(args, "transports", None)
    model = getattr(args, "model", "llama-3.1-8b")
    max_context, num_pages, max_tokens = 2048, 1024, args.pd_tokens
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_worker, args=(child, transports, max_context, num_pages, model), daemon=True)
    proc.start()
    res: dict = {"model": f"{model} (dummy, seed 0)", "max_tokens": max_tokens, "requests": [],
                 "devices": [src_dev, dst_dev]}
    try:
        p = ModelRunner(_runner_cfg(src_dev, max_context, num_pages, model))
        ref = Engine(config=_runner_cfg(src_dev, max_context, num_pages, model), loaded=(p.model, None))
        eng = _engine("prefill-gpu0", transports, bool(getattr(args, "transfer_busy_poll", False)))
        pbufs = p.kv_pool.buffers()
        for b in pbufs:
            eng.register_memory(b.data_ptr(), b.numel() * b.element_size(), src_dev)
        desc_bytes, dptrs = parent.recv()
        desc = registry_pb2.SegmentDescriptor()
        desc.ParseFromString(desc_bytes)
        seg = eng.open_segment(desc)
        g = torch.Generator().manual_seed(7)
        p1 = torch.randint(0, p.vocab_size, (1000,), generator=g).tolist()
        p2 = p1[:512] + torch.randint(0, p.vocab_size, (300,), generator=g).tolist()
        ps = p.page_size
        for rid, (prompt, pre_from, pre_len) in enumerate([(p1, None, 0), (p2, 0, 512)]):
            n = len(prompt)
            parent.send(("req", rid, n, pre_from, pre_len, max_tokens))
            _, dst_pages = parent.recv()
            row = p.req_to_token_pool.alloc()
            slots = p.allocator.alloc_slots(0, n, None)
            p.req_to_token_pool.write(row, 0, slots)
            t0 = time.perf_counter()
            logits = p.forward(ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [prompt], slots, src_dev))
            first = int(logits.argmax(-1))
            t_prefill = time.perf_counter() - t0
            src_pages = (slots[pre_len:n:ps] // ps).tolist()
            assert len(src_pages) == len(dst_pages), (len(src_pages), len(dst_pages))
            runs = _runs(src_pages, dst_pages)
            pb = p.kv_pool.page_stride_bytes  # page_major: one range per run; layer_major: one per buffer
            descs = [(sp + s * pb, dp + d * pb, k * pb) for sp, dp in zip([b.data_ptr() for b in pbufs], dptrs)
                     for s, d, k in runs]
            torch.cuda.synchronize()  # pages complete before UCX reads them
            t1 = time.perf_counter()
            st = eng.wait(eng.submit(seg, descs))
            t_xfer = time.perf_counter() - t1
            if st.state is not State.COMPLETED:
                raise RuntimeError(f"KV transfer failed: {st}")
            parent.send(("first", first))
            _, toks, itl_ms = parent.recv()
            want = ref.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0].token_ids
            p.allocator.free_slots(slots)
            p.req_to_token_pool.free(row)
            r = {"request": rid, "prompt_tokens": n, "pre_len_on_D": pre_len, "pages_sent": len(src_pages),
                 "puts": len(descs), "bytes": st.bytes_total, "prefill_ms": t_prefill * 1e3,
                 "transfer_ms": t_xfer * 1e3, "decode_itl_ms": itl_ms, "pd_tokens": toks, "colocated_tokens": want,
                 "equal": toks == want}
            res["requests"].append(r)
            print({k: v for k, v in r.items() if not k.endswith("tokens")}, flush=True)
        res["all_equal"] = all(r["equal"] for r in res["requests"])
        eng.close()
    finally:
        parent.send(("exit",))
        proc.join(60)
    return res

"""GPU path: flashinfer attention vs the torch reference, CUDA-graph decode vs eager, our bf16/fp32
model vs transformers with the same random weights. GPU tests skip without CUDA; the page-table and
backend-selection tests run everywhere (they are plain torch).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from engine.attention import create_backend, resolve_backend_name
from engine.cpu_kernels import PAGED_DECODE
from engine.attention.flashinfer_backend import page_table
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.req_to_token_pool import ReqToTokenPool

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_page_table_matches_rows():
    ps = 4
    r2t = ReqToTokenPool(4, 64, "cpu")
    pages = {1: [7, 2, 9], 3: [0], 0: [5, 6]}
    lens = {1: 11, 3: 4, 0: 5}
    for row, pl in pages.items():
        slots = torch.tensor([p * ps + o for p in pl for o in range(ps)])[: lens[row]]
        r2t.write(row, 0, slots)
    rows = torch.tensor([1, 3, 0])
    indptr, idx, last = page_table(r2t.req_to_token, rows, torch.tensor([11, 4, 5]), ps)
    assert indptr.tolist() == [0, 3, 4, 6]
    assert idx.tolist() == [7, 2, 9, 0, 5, 6]
    assert last.tolist() == [3, 4, 1]
    assert idx.dtype == torch.int32 and indptr.dtype == torch.int32


def test_page_table_of_an_empty_row_has_no_page():
    # extend over prefixes plans the prefix part with seq = pre_len, which is 0 for a fresh request;
    # flashinfer reads kv_len = max(pages - 1, 0) * page_size + last_page_len, so last must be 0 there
    ps = 4
    r2t = ReqToTokenPool(3, 16, "cpu")
    r2t.write(0, 0, torch.arange(8, 14))
    r2t.write(2, 0, torch.arange(4, 8))
    indptr, idx, last = page_table(r2t.req_to_token, torch.tensor([0, 1, 2]), torch.tensor([6, 0, 4]), ps)
    assert indptr.tolist() == [0, 2, 2, 3]
    assert idx.tolist() == [2, 3, 1]
    assert last.tolist() == [2, 0, 4]


def test_graph_blas_is_cublaslt_from_bucket_32_unless_the_env_says():
    from engine.cuda_graph_runner import CUBLASLT_FROM_BUCKET, DEFAULT_BUCKETS, graph_blas

    assert CUBLASLT_FROM_BUCKET == 32
    assert [graph_blas(b) for b in DEFAULT_BUCKETS[:8]] == ["cublas"] * 7 + ["cublaslt"]  # 1..24 | 32
    assert all(graph_blas(b) == "cublaslt" for b in DEFAULT_BUCKETS if b >= 32)
    assert graph_blas(128, "cublas") == "cublas" and graph_blas(1, "cublaslt") == "cublaslt"
    with pytest.raises(ValueError, match="HALFMOON_DECODE_GRAPH_BLAS='cublass'"):
        graph_blas(8, "cublass")


def test_decode_attention_per_bucket_follows_the_env_or_the_measured_buckets(monkeypatch):
    from engine import cuda_graph_runner as cgr

    monkeypatch.delenv("HALFMOON_DECODE_ATTN", raising=False)
    assert cgr.SPLIT_KV_BUCKETS == {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128}  # measured (GPU_NOTES sessions 20-21)
    assert [cgr.decode_attention(b) for b in (1, 2, 4, 8, 12, 16, 32, 64, 128, 160, 256)] == [
        "split_kv", "split_kv", "split_kv", "split_kv", "split_kv", "split_kv", "split_kv", "split_kv",
        "split_kv", "flashinfer", "flashinfer"]
    assert cgr.decode_attention(1, "flashinfer") == "flashinfer" and cgr.decode_attention(64, "split_kv") == "split_kv"
    monkeypatch.setenv("HALFMOON_DECODE_ATTN", "flashinfer")
    assert cgr.decode_attention(1) == "flashinfer"
    with pytest.raises(ValueError, match="HALFMOON_DECODE_ATTN='xqa'"):
        cgr.decode_attention(1, "xqa")


def test_graph_page_ids_match_page_table():
    # the CUDA graph gathers page ids itself from the planned indptr (fixed shape); the same tensor ops
    # run on the CPU here against page_table for random rows, lengths and a padded bucket
    from engine.cuda_graph_runner import CudaGraphRunner

    ps, max_ctx, b, B = 4, 64, 6, 4
    r2t = ReqToTokenPool(8, max_ctx, "cpu")
    g = torch.Generator().manual_seed(0)
    for row in range(8):
        r2t.write(row, 0, torch.randperm(100, generator=g)[: max_ctx // ps].repeat_interleave(ps) * ps
                  + torch.arange(ps).repeat(max_ctx // ps))
    rows = torch.tensor([5, 1, 7, 2])
    seq = torch.tensor([9, 1, 64, 17])
    gr = CudaGraphRunner.__new__(CudaGraphRunner)
    gr.page_size, gr.max_context, gr.pages_per_row = ps, max_ctx, max_ctx // ps
    gr.runner = type("R", (), {"req_to_token_pool": r2t})()
    gr.rows = torch.cat([rows, torch.zeros(b - B, dtype=torch.int64)])
    gr.page_slot = torch.arange(b * gr.pages_per_row, dtype=torch.int32)
    gr.indices = torch.full((b * gr.pages_per_row + b,), -1, dtype=torch.int32)
    full_seq = torch.cat([seq, torch.ones(b - B, dtype=torch.int64)])
    npages = (full_seq + ps - 1) // ps
    indptr = torch.zeros(b + 1, dtype=torch.int32)
    torch.cumsum(npages, 0, out=indptr[1:])
    gr.indptr = {b: indptr}
    gr._fill_page_ids(b)
    ref_indptr, ref_idx, _ = page_table(r2t.req_to_token, rows, seq, ps)
    n = int(ref_indptr[-1])
    assert indptr[: B + 1].tolist() == ref_indptr.tolist()
    assert gr.indices[:n].tolist() == ref_idx.tolist()
    # pad entries read page 0 of row 0 (read only)
    assert gr.indices[n:n + b - B].tolist() == [int(r2t.req_to_token[0, 0]) // ps] * (b - B)


def test_graph_runners_planned_backend_offers_the_backends_interface():
    # the model calls the same backend methods inside a captured graph as outside it (FusedOps checks
    # has_attend and reads kv_pool): the graph runner's wrapper must pass them through
    from engine.attention.torch_paged_backend import TorchPagedAttentionBackend
    from engine.cuda_graph_runner import _Planned

    calls = []

    class Attending(TorchPagedAttentionBackend):
        has_attend = True

        def attend(self, q, k, v, layer, batch):
            calls.append(("attend", layer))
            return q

        def set_wrapper(self, wrapper):
            calls.append(("set_wrapper", wrapper))

    pool = KVPool(4, 4, 1, 2, 8, torch.float32, "cpu")
    be = Attending(pool, ReqToTokenPool(2, 16), 2, 2, 8)
    p = _Planned(be, "w")
    assert p.has_attend and p.kv_pool is pool and p.num_heads == 2
    q = torch.zeros(1, 2, 8)
    p.init_forward(None)
    assert p.attend(q, q, q, 0, None) is q
    assert calls == [("set_wrapper", "w"), ("attend", 0)]
    plain = _Planned(TorchPagedAttentionBackend(pool, ReqToTokenPool(2, 16), 2, 2, 8), "w")
    assert not plain.has_attend
    with pytest.raises(NotImplementedError):
        plain.attend(q, q, q, 0, None)


def test_auto_backend_is_never_flashinfer_on_cpu_or_fp32():
    """flashinfer only for CUDA half types: CPU takes the CPU kernel when it is built (else
    torch_paged, tests/unit/test_attention_cpu_paged.py), a float32 CUDA pool torch_paged."""
    cpu = "cpu_paged" if PAGED_DECODE.load()[0] is not None else "torch_paged"
    assert resolve_backend_name("auto", torch.device("cpu"), torch.bfloat16) == cpu
    assert resolve_backend_name("auto", torch.device("cuda"), torch.float32) == "torch_paged"
    pool = KVPool(4, 4, 1, 2, 8, torch.float32, "cpu")
    b = create_backend("auto", kv_pool=pool, req_to_token_pool=ReqToTokenPool(2, 16), num_heads=2,
                       num_kv_heads=2, head_dim=8)
    assert type(b).__name__ == {"cpu_paged": "CpuPagedAttentionBackend", "torch_paged": "TorchPagedAttentionBackend"}[cpu]
    with pytest.raises(ValueError, match="flashinfer needs a CUDA"):
        create_backend("flashinfer", kv_pool=pool, req_to_token_pool=ReqToTokenPool(2, 16), num_heads=2,
                       num_kv_heads=2, head_dim=8)


@pytest.mark.gpu
@cuda
def test_flashinfer_matches_torch_backend():
    from bench.gpu import backend_vs_torch

    for pb in ("fa2", "fa3"):
        for mode, layout in (("ragged", "page_major"), ("paged", "page_major"), ("ragged", "layer_major")):
            for seed in (0, 1):
                r = backend_vs_torch(seed=seed, extend_mode=mode, layout=layout, prefill_backend=pb)
                assert r["extend_rel_err"] <= 1e-2, (pb, mode, r)
                assert r["extend_no_prefix_rel_err"] <= 1e-2, (pb, mode, r)
                assert r["decode_rel_err"] <= 1e-2, (pb, mode, r)


TINY = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, max_position_embeddings=4096)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", ["llama-3.1-8b", "qwen2.5-7b"])
def test_model_matches_transformers_on_gpu(shape):
    from bench.gpu import model_vs_transformers

    with tempfile.TemporaryDirectory() as tmp:
        bf = model_vs_transformers(shape, 2, "bf16", tmp, overrides=TINY)
        fp = model_vs_transformers(shape, 2, "fp32", tmp, overrides=TINY)
    assert bf["backend"] == "FlashInferAttentionBackend" and bf["cuda_graph"] and bf["fused_ops"], bf
    assert bf["rel_err_vs_hf_fp32"] <= 2e-2, bf
    assert bf["rel_err_vs_hf_bf16"] <= 2e-2, bf
    assert fp["rel_err_vs_hf_fp32"] <= 1e-4, fp


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("decode_attn,pdl", [("", ""), ("split_kv", ""), ("flashinfer", ""), ("", "0")])
@pytest.mark.parametrize("n_req,max_bs,bucket", [(3, 8, 4), (29, 32, 32)])
def test_graph_decode_equals_eager_and_pads_safely(n_req, max_bs, bucket, decode_attn, pdl, monkeypatch):
    """A decode batch of 3 (bucket 4: o/down on tinygemm) or 29 (bucket 32: captured under cuBLASLt)
    through the graph equals the eager forward (flashinfer's decode wrapper), and the pad entries
    write only the scratch page. Unset, each bucket takes its default attention (``decode_attention``:
    both buckets here attend with engine.attention.split_kv_decode; bucket 4: 4 x 2 kv heads -> 32
    splits, most of them empty, merged in-kernel); ``HALFMOON_DECODE_ATTN`` forces one kernel for
    every bucket ("flashinfer": the graph-mode wrapper, planned on the host before each replay).
    The split-KV buckets launch the RoPE + K/V store and the attention with programmatic dependent
    launch (each waiting for the kernel before it) unless ``HALFMOON_DECODE_PDL=0``."""
    monkeypatch.setenv("HALFMOON_DECODE_ATTN", decode_attn)
    monkeypatch.setenv("HALFMOON_DECODE_PDL", pdl)
    from engine.config import EngineConfig
    from engine.cuda_graph_runner import decode_attention
    from engine.forward_batch import ForwardBatch, ForwardMode
    from engine.model_runner import ModelRunner

    import json
    from pathlib import Path

    from engine.config import CONFIGS_DIR

    tmp = tempfile.mkdtemp()
    cfg = json.loads((CONFIGS_DIR / "llama-3.1-8b.json").read_text())
    cfg.update(TINY, num_hidden_layers=2)  # head_dim 128: the kernels the benchmarks compile anyway
    (Path(tmp) / "config.json").write_text(json.dumps(cfg))
    r = ModelRunner(EngineConfig(model=tmp, load_format="dummy", dtype="bfloat16", device="cuda",
                                 num_pages=256, max_running_requests=max_bs, max_context=512,
                                 cuda_graph_max_bs=max_bs))
    assert r.graph_runner is not None and r.graph_runner.bucket_for(n_req) == bucket
    gr = r.graph_runner
    assert gr.attn[bucket] == (decode_attn or decode_attention(bucket, ""))
    assert gr.attn[1] == (decode_attn or "split_kv")
    assert gr.pdl is (pdl != "0")
    for buf in r.kv_pool.buffers():
        buf.normal_()
    rows, locs, lens = [], [], ([5, 40, 17] + [3 + 7 * i % 60 for i in range(n_req - 3)])[:n_req]
    for n in lens:
        row = r.req_to_token_pool.alloc()
        s = r.allocator.alloc_slots(0, n + 1, None)
        r.req_to_token_pool.write(row, 0, s)
        rows.append(row)
        locs.append(s)
    pool = r.kv_pool

    def views():  # per layer K, V [pages, page_size, kvh, hd], in either layout
        return [t for i in range(pool.num_layers) for t in (pool.k_pages(i), pool.v_pages(i))]

    before = [t.clone() for t in views()]
    batch = ForwardBatch.build(ForwardMode.DECODE, rows, lens, [[i + 1] for i in range(n_req)],
                               torch.stack([s[n] for s, n in zip(locs, lens)]), "cuda")
    got = r.forward(batch).clone()
    with torch.inference_mode():
        want = r.model(batch, r.backend)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    ps = r.page_size
    written = set(int(s[n]) for s, n in zip(locs, lens))
    scratch = set(range(r.scratch_page * ps, (r.scratch_page + 1) * ps))
    for b0, b1 in zip(before, views()):
        changed = set((b0 != b1).any(-1).any(-1).flatten().nonzero().flatten().tolist())  # slot ids
        assert changed <= written | scratch, changed - written - scratch

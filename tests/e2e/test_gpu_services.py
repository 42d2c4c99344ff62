"""The GPU path end to end, one process per service as ``halfmoon up`` starts them: the registry, a
prefill worker on cuda:0, a decode worker on cuda:1 (both on cuda:0 on a one-GPU machine), bf16,
flashinfer attention and CUDA graphs (what the workers choose on CUDA), the KV moved GPU -> GPU by
our transfer engine (UCX picks cuda_ipc), and the router. Through the router's gRPC API and its
OpenAI HTTP API (the real ``openai`` client) the tokens equal those of the co-located engine on one
GPU with the same weights; a prompt that shares a 544-token prefix with an earlier one finds it on D
and only its delta pages move; afterwards the KV accounting invariant holds and no lock is held.

Weights: ``--load-format dummy`` (seeded random weights, the same in every process) over a model
directory with config.json and the tokenizer files: ``$HALFMOON_GPU_MODEL_DIR``
(``scripts/make_gpu_model_dir.sh`` makes one), else one made in tmp from the local model cache,
else the test is skipped.

Equal results need equal arithmetic: every request runs alone (decode batch 1 on both sides, the same
CUDA-graph buckets) and the reference runs the same requests in the same order with the same
chunked-prefill size, so prefix-cache hits (the shared prompt) are the same on both sides. Random
weights often repeat one token whatever the context, so tokens alone prove little: every token's
logprob is compared too (identical arithmetic gives identical float32 values; measured on CPU, one
prompt token changed 300 positions back moves them by 3e-3, a different chunking by 1e-6).

Mechanics without a GPU (float32, torch attention; not in the default suite, which deselects -m gpu):
    HALFMOON_GPU_TEST_DEVICES=cpu,cpu .venv/bin/python -m pytest -m gpu tests/e2e/test_gpu_services.py
``HALFMOON_GPU_TEST_DTYPE`` overrides the dtype (default bfloat16 on CUDA, float32 on CPU).
"""

from __future__ import annotations

import importlib
import json
import os
import re

import pytest
import torch

from tests.e2e.gpu_setup import (
    CHUNK, LOGPROB_TOL, LONG, MAX_TOKENS, PAGE, SEED, SHARED, TEMPERATURE, Case, Setup, colocated, devices,
    model_dir)
from tests.integration.conftest import assert_idle_accounting

# the first test also waits for the reference run and the workers' start (flashinfer may JIT-compile)
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

SERVICE_MODULES = ("grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "protos.router_pb2_grpc",
                   "fastapi", "uvicorn", "openai")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    p_dev, d_dev = devices()
    pytest.importorskip("libucx", reason="the transfer engine binds libucp from the libucx package")
    missing = []
    for mod in SERVICE_MODULES:
        try:
            importlib.import_module(mod)
        except Exception as e:  # ImportError, or the grpc stubs' RuntimeError for an old grpcio
            missing.append(f"{mod}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if missing:
        pytest.fail("the services need these Python packages here (pyproject dependencies / [test] extra):\n  "
                    + "\n  ".join(missing), pytrace=False)
    dtype = os.environ.get("HALFMOON_GPU_TEST_DTYPE") or ("bfloat16" if p_dev.startswith("cuda") else "float32")
    return Setup(p_dev, d_dev, dtype, model_dir(tmp_path_factory.mktemp("gpu-model")))


@pytest.fixture(scope="module")
def tok(setup):
    from router_svc.tokenizer import RouterTokenizer

    return RouterTokenizer(setup.model_dir.name, setup.model_dir)  # what the router loads from --model


LONG_TEXT = "".join(f"Log {i}: the keeper of light {i % 7} counted {3 * i + 1} ships and {i * i % 97} gulls "
                    f"before the {['storm', 'fog', 'dawn', 'tide'][i % 4]} came. " for i in range(120))
HTTP_TEXT = "Write one sentence about the oldest lighthouse on the northern coast:"
STREAM_TEXT = "List three things a ship's cook keeps in the galley during a long voyage:"
STOP_TEXT = "Describe the sound of a foghorn at night in a few words:"
CHAT = [{"role": "user", "content": "Why did lighthouses need keepers before electricity?"}]


@pytest.fixture(scope="module")
def cases(setup, tok) -> dict[str, Case]:
    """Every request of the module and its reference output: the co-located engine (one process, the
    prefill worker's device), same weights and config, the requests one at a time in module order."""
    long_ids = tok.encode(LONG_TEXT)[:LONG]
    assert len(long_ids) == LONG
    tail = tok.encode(" Question: which storm sank the most ships, and who rang the bell?")
    assert tail[0] != long_ids[SHARED]
    cs = [Case("one", tok.encode("Lighthouse")[:1]),
          Case("forty", tok.encode("The keeper climbed the ninety-nine stairs of the tower at dusk, "
                                   "lit the great lamp, wound the clockwork that turned the lens, and")),
          Case("long", long_ids),
          Case("shared", long_ids[:SHARED] + tail),       # after "long": D and P hold its prefix
          Case("sampled", tok.encode("A short poem about the sea, in the voice of a gull:"), TEMPERATURE, SEED),
          Case("http", tok.encode(HTTP_TEXT)),
          Case("http_stream", tok.encode(STREAM_TEXT)),
          Case("chat", tok.encode_chat(CHAT)),
          Case("stop", tok.encode(STOP_TEXT))]
    for a in cs:  # only "shared" may share a page with an earlier prompt
        for b in cs:
            if a is not b and (a.name, b.name) not in (("long", "shared"), ("shared", "long")):
                assert a.ids[:PAGE] != b.ids[:PAGE] or len(a.ids) < PAGE or len(b.ids) < PAGE, (a.name, b.name)
    colocated(setup, cs)
    return {c.name: c for c in cs}


@pytest.fixture(scope="module")
def stack(setup, cases, tmp_path_factory):
    """Registry, P, D and router from ``halfmoon up``'s launcher (started after the reference ran, so
    flashinfer's JIT-compiled modules are in its cache for the workers)."""
    from halfmoon.launcher import Stack, StackConfig

    log_dir = tmp_path_factory.mktemp("gpu-stack")
    mp = pytest.MonkeyPatch()
    mp.setenv("UCX_PROTO_INFO", "y")  # the workers' UCX logs the protocol it picks for each operation
    cfg = StackConfig(model=str(setup.model_dir), prefill=1, decode=1, base_port=0, kv_memory_mb=128,
                      torch_threads=4 if setup.cuda else 1, log_dir=str(log_dir), ready_timeout=420,
                      stop_timeout=15, prefill_device=setup.prefill_device, decode_device=setup.decode_device,
                      dtype=setup.dtype, load_format="dummy",
                      worker_args=["--chunked-prefill-size", str(CHUNK), "--max-running-requests", "8",
                                   "--transfer-log", str(log_dir / "transfer.jsonl")])
    try:
        with Stack(cfg) as st:
            yield st
            dead = [p.name for p in st.dead()]
            assert not dead, f"processes died during the tests: {dead}; logs in {log_dir}"
    finally:
        mp.undo()
    leftovers = [p.name for p in st.procs if p.alive()]
    assert not leftovers, f"processes left running after stop: {leftovers}"


@pytest.fixture(scope="module")
def served_model(stub) -> str:
    from protos import router_pb2

    (m,) = stub.ListModels(router_pb2.ListModelsRequest()).models
    return m.id


def _generate(stub, case: Case, request_id: str):
    """(token ids, logprobs, last GenerateResponse) of ``case`` through Router.Generate (token ids in)."""
    from protos import common_pb2, router_pb2

    s = common_pb2.SamplingParams(temperature=case.temperature, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  logprobs=True)
    if case.seed is not None:
        s.seed = case.seed
    resps = list(stub.Generate(router_pb2.GenerateRequest(request_id=request_id, token_ids=router_pb2.TokenIds(
        ids=case.ids), sampling=s), timeout=300))
    ids = [t for r in resps for t in r.token_ids]
    lps = [lp for r in resps for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == ids
    return ids, [lp.logprob for lp in lps], resps[-1]


def _kv_bytes_per_page(setup: Setup) -> int:
    from engine.config import ModelConfig, _parse_dtype

    mc = ModelConfig.from_dir(setup.model_dir)
    elt = torch.empty(0, dtype=_parse_dtype(setup.dtype)).element_size()
    return 2 * mc.num_layers * PAGE * mc.num_kv_heads * mc.head_dim * elt


def _batches(stack, request_id: str) -> list[dict]:
    log = stack.log_dir / "transfer.jsonl"  # P's --transfer-log: one line per KV batch and notice
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    # workers see the router's per-tenant id, ``<tenant>/<request_id>`` (router_svc/validation.py)
    return [r for r in recs if r["event"] == "batch" and r.get("request_id", "").split("/", 1)[-1] == request_id]


def test_reference_depends_on_the_prompt(cases):
    """The random-weight model still answers different prompts differently, and the shared-prefix
    prompt differently from the one it shares 544 tokens with (else equality would prove little)."""
    assert len({tuple(c.ref) for c in cases.values()}) >= len(cases) // 2, [c.ref for c in cases.values()]
    a, b = cases["long"], cases["shared"]
    assert a.ref != b.ref or max(abs(x - y) for x, y in zip(a.ref_logprobs, b.ref_logprobs)) > 10 * LOGPROB_TOL


def test_workers_run_where_asked(setup, stack):
    """Each worker logs what it runs on: the device asked for, and on CUDA bf16 + flashinfer + CUDA
    graphs chosen by the engine (nothing forces them) and UCX free to pick its CUDA transports."""
    rx = re.compile(r"engine: device=(\S+) dtype=(\S+) attention=(\S+) cuda_graphs=(off|\[[^\]]*\]) "
                    r"kv_pages=(\d+) ucx_tls=(.+)")
    for name, dev in (("prefill-0", setup.prefill_device), ("decode-0", setup.decode_device)):
        proc = next(p for p in stack.procs if p.name == name)
        m = rx.search(proc.log.read_text(errors="replace"))
        assert m, f"{name}: no engine line in {proc.log}"
        want = dev if ":" in dev or dev == "cpu" else f"{dev}:0"
        assert (m.group(1), m.group(2)) == (want, setup.dtype), (name, m.group(0))
        if setup.cuda:
            assert m.group(3) == "FlashInferAttentionBackend" and m.group(4) != "off", (name, m.group(0))
            assert m.group(6) == "(UCX's choice)", (name, m.group(0))
        else:
            # auto on CPU: torch_paged (engine/attention/__init__.py)
            assert (m.group(3), m.group(4), m.group(6)) == ("TorchPagedAttentionBackend", "off", "sm"), \
                (name, m.group(0))


def test_grpc_greedy_equals_colocated_and_shared_prefix_moves_the_delta(setup, stack, stub, cases):
    page_bytes = _kv_bytes_per_page(setup)
    problems = []
    for name in ("one", "forty", "long", "shared"):
        c = cases[name]
        ids, lps, last = _generate(stub, c, f"gpu-{name}")
        problems += c.problems(ids, lps, "gRPC")
        u = last.usage
        assert last.finish_reason == "length" and u.completion_tokens == MAX_TOKENS, name
        assert u.prompt_tokens == len(c.ids) and 0 <= u.cached_tokens <= u.prompt_tokens, name
        assert (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
        pre = u.decode_prefix_tokens
        pages = -(-len(c.ids) // PAGE) - pre // PAGE
        if name == "shared":
            # D holds the 34 shared pages from "long" (radix hit), P reused its own cache for them
            assert pre == SHARED and u.cached_tokens == SHARED, u
        else:
            assert pre == 0, (name, u)
        assert u.kv_pages_transferred == pages and u.kv_bytes_transferred == pages * page_bytes, (name, u)
        logged = [p for b in _batches(stack, f"gpu-{name}") for p in b["logical_pages"]]
        assert logged == list(range(pre // PAGE, -(-len(c.ids) // PAGE))), (name, logged)
        assert sum(b["bytes"] for b in _batches(stack, f"gpu-{name}")) == pages * page_bytes
    assert not problems, "\n".join(problems)


def ucx_put_protocols(log: str) -> list[tuple[str, list[str]]]:
    """(what, configs) of each ``ucp_put*`` protocol table that UCX_PROTO_INFO=y printed, e.g.
    ("from cuda/GPU0 to cuda/dev[1]", ["cuda_ipc/cuda"]): the transports the KV writes took."""
    out, what, seps = [], None, 0
    for line in log.splitlines():
        text = line.split("]", 2)[-1].strip()
        if "remote memory write by ucp_put" in text:
            what, seps = text.split("ucp_put*", 1)[-1].strip(" |"), 0
            out.append((what, []))
        elif what is not None and text.startswith("+"):
            seps += 1
            if seps == 3:
                what = None
        elif what is not None and seps == 2 and text.startswith("|"):
            out[-1][1].append(text.strip("|").split("|")[-1].strip())
    return out


def test_kv_writes_took_the_device_transport(setup, stack):
    """After the requests above: P's UCX wrote the KV pages GPU -> GPU with cuda_ipc (host memory over
    shared memory in the CPU dry run), not staged through the host."""
    proc = next(p for p in stack.procs if p.name == "prefill-0")
    puts = ucx_put_protocols(proc.log.read_text(errors="replace"))
    assert puts, f"no UCX put protocol table in {proc.log} (UCX_PROTO_INFO=y)"
    if setup.cuda:
        cuda = [(w, c) for w, c in puts if w.startswith("from cuda")]
        assert cuda and all(any("cuda_ipc" in x for x in c) for _, c in cuda), puts
    else:
        assert all(w.startswith("from host") and not any("cuda" in x for x in c) for w, c in puts), puts


def test_seeded_sampling_equals_colocated(stub, cases):
    """temperature 0.5, seed 1234: P samples the first token, D continues from P's generator state
    (on the logits' device), the co-located engine draws the same sequence."""
    c = cases["sampled"]
    ids, lps, last = _generate(stub, c, "gpu-sampled")
    problems = c.problems(ids, lps, "gRPC")
    assert not problems, "\n".join(problems)
    assert last.usage.kv_pages_transferred == -(-len(c.ids) // PAGE)


def test_openai_http_equals_colocated(client, served_model, cases, tok):
    """Text prompt, streamed text prompt, chat messages: the text of the reference tokens (the router
    detokenizes), and each token's logprob where the API returns it."""
    def text_problem(c: Case, got: str, via: str) -> list[str]:
        want = tok.hf.decode(c.ref, skip_special_tokens=True)
        return [] if got == want else [f"{c.name} via {via}: text {got!r} != reference {want!r}"]

    c = cases["http"]
    r = client.completions.create(model=served_model, prompt=HTTP_TEXT, max_tokens=MAX_TOKENS, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})
    problems = text_problem(c, r.choices[0].text, "/v1/completions")
    problems += c.problems(None, r.choices[0].logprobs.token_logprobs, "/v1/completions")
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(c.ids), MAX_TOKENS)

    c = cases["http_stream"]
    stream = client.completions.create(model=served_model, prompt=STREAM_TEXT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    problems += text_problem(c, "".join(ch.choices[0].text for ch in stream), "/v1/completions stream")

    c = cases["chat"]
    r = client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, extra_body={"ignore_eos": True})
    problems += text_problem(c, r.choices[0].message.content, "/v1/chat/completions")
    problems += c.problems(None, [x.logprob for x in r.choices[0].logprobs.content], "/v1/chat/completions")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(c.ids), MAX_TOKENS)
    assert not problems, "\n".join(problems)


def test_stop_string_with_dummy_weights(client, served_model, cases, tok):
    """A stop string needs the decode worker's tokenizer: with --load-format dummy it comes from the
    model directory. The text ends right before the first occurrence of the stop string."""
    full = tok.hf.decode(cases["stop"].ref, skip_special_tokens=True)
    words = [m.group(0) for m in re.finditer(r"[A-Za-z]{3,}", full) if m.start() > 0]
    if not words:
        pytest.skip(f"no 3-letter word after the start of the reference text {full!r} to stop on")
    word = words[0]
    r = client.completions.create(model=served_model, prompt=STOP_TEXT, max_tokens=MAX_TOKENS, temperature=0,
                                  stop=[word], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(word)]


@pytest.mark.parametrize("kind, grammar, check", [
    ("regex", r"(yes|no), [0-9]{2}\.", lambda t: re.fullmatch(r"(yes|no), [0-9]{2}\.", t)),
    ("ebnf", 'root ::= "red" | "green" | "blue"', lambda t: t in ("red", "green", "blue")),
    ("json_schema", json.dumps({"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "required": ["c"],
                                "additionalProperties": False}),
     lambda t: json.loads(t)["c"] in ("a", "b")),
], ids=["regex", "ebnf", "json_schema"])
def test_grammar_bitmask_on_the_logits_device(stub, kind, grammar, check):
    """The xgrammar bitmask is applied where the logits are (engine/grammar.py: CUDA on the GPU
    path): with dummy weights only the grammar can make the output match, on P's first token and
    on every token D samples after it."""
    from protos import common_pb2, router_pb2

    s = common_pb2.SamplingParams(temperature=0, max_tokens=48)
    setattr(s.structured, kind, grammar)
    resps = list(stub.Generate(router_pb2.GenerateRequest(request_id=f"gpu-grammar-{kind}", text="Answer:",
                                                          sampling=s), timeout=300))
    text = "".join(r.text for r in resps)
    assert resps[-1].finish_reason == "stop", (kind, text, resps[-1].finish_reason)
    assert check(text), (kind, text)


def test_kv_accounting_idle_after_everything(stack):
    from tests.e2e.conftest import worker_targets

    acc = assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())
    assert acc["decode"].evictable_pages > 0  # D's radix cache kept the prompts (what made "shared" cheap)

"""logit_bias and grammar masks in the sampler (engine/sampler.py ``constrain``), on the real
tokenizer's xgrammar compiler: a bias forces or bans tokens for greedy and seeded rows, a grammar
allows only its tokens, the state advances with each chosen token and terminates with EOS."""

import json

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from engine.model_store import resolve_model
from engine.sampler import make_generator, sample
from engine.sampling_params import SamplingParams

V = 49152


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
    return tok, GrammarCompiler(tok, V, [tok.eos_token_id])


def test_logit_bias_forces_and_bans():
    logits = torch.randn(3, V)
    greedy = logits.argmax(-1)
    params = [SamplingParams(temperature=0, logit_bias={7: 100}),
              SamplingParams(temperature=0, logit_bias={int(greedy[1]): -100}),
              SamplingParams(temperature=1.0, logit_bias={9: 100.0}, logprobs=True)]
    out = sample(logits, params, [None, None, make_generator(0)], [[1]] * 3, [[]] * 3)
    assert out.token_ids[0] == 7 and out.token_ids[1] != int(greedy[1]) and out.token_ids[2] == 9
    # logprobs are the raw distribution's, not the biased one
    assert out.logprobs[2] == pytest.approx(float(torch.log_softmax(logits[2], -1)[9]), abs=1e-5)


@pytest.mark.parametrize("bias", [{V: 1.0}, {-1: 1.0}, {1: 100.5}, {1: float("nan")}, {1: "x"}])
def test_logit_bias_validation_names_the_field(bias):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias=bias).validate(V, 2048, 4)
    assert e.value.field == "logit_bias"


def test_grammar_masks_advances_and_terminates(compiler):
    tok, comp = compiler
    st = comp.state(GrammarSpec(GrammarKind.REGEX, "ab"))
    ids = []
    for _ in range(8):
        logits = torch.randn(1, V)
        out = sample(logits, [SamplingParams(temperature=0)], [None], [[1]], [ids], [st])
        ids += out.token_ids
        if st.terminated:
            break
    assert st.terminated and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1]) == "ab"


def test_json_schema_on_random_logits(compiler):
    tok, comp = compiler
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    st = comp.state(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema)))
    gen, ids = make_generator(3), []
    while not st.terminated and len(ids) < 40:
        ids += sample(torch.randn(1, V), [SamplingParams(temperature=1.0)], [gen], [[1]], [ids], [st]).token_ids
    assert json.loads(tok.decode(ids[:-1]))["k"] in ("x", "y")


@pytest.mark.parametrize("spec", [GrammarSpec(GrammarKind.JSON_SCHEMA, "{nope"),
                                  GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "nope"}'),
                                  GrammarSpec(GrammarKind.JSON_SCHEMA, "[1]"),
                                  GrammarSpec(GrammarKind.REGEX, "("), GrammarSpec(GrammarKind.REGEX, ""),
                                  GrammarSpec(GrammarKind.EBNF, "root ::= "),
                                  GrammarSpec(GrammarKind.REGEX, "a" * 70000)])
def test_invalid_grammars_name_the_field(compiler, spec):
    with pytest.raises(InvalidRequestError) as e:
        compiler[1].compile(spec)
    assert e.value.field == "structured"

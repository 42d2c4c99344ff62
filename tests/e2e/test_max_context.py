"""``halfmoon up --max-context N`` on the real stack: /v1/models reports N, a chat without
``max_tokens`` gets the rest of N (not of the model's 8192-token window), and a request past N is a
400 ``context_length_exceeded`` from the real ``openai`` client."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import MODEL, stack_fixture, worker_targets
from tests.integration.conftest import assert_idle_accounting

CAP = 128
stack = stack_fixture(1, 1, max_context=CAP)

# rambles on past the cap with greedy decoding on the default model (never an early EOS)
LONG = "Write a long story about a dragon who learns to bake bread."


def test_models_report_the_cap(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == CAP


def test_chat_without_max_tokens_gets_the_rest_of_the_cap(client, stack):
    r = client.chat.completions.create(model=MODEL, temperature=0,
                                       messages=[{"role": "user", "content": LONG}])
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == CAP
    short = client.chat.completions.create(model=MODEL, temperature=0,
                                           messages=[{"role": "user", "content": "Say hi."}])
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < CAP // 2
    assert_idle_accounting(worker_targets(stack), credentials=stack.credentials.client())


def test_past_the_cap_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, max_tokens=CAP,
                                       messages=[{"role": "user", "content": "Say hi."}])
    err = ei.value.body
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert f"{CAP} tokens" in err["message"]

"""The router's front door in process: API key files and tenants, bearer parsing, the flags and their
start-up errors (a bad key file names the line, never the key), the token bucket and the admission
queue, tenant-scoped worker request ids, and the 429 mapping of RouterError. The real router
process is tests/e2e/test_router_front_door.py."""

from __future__ import annotations

import argparse
import logging

import grpc
import pytest

from protos import common_pb2
from router_svc import front_door
from router_svc.admission import Admission
from router_svc.api_keys import ANONYMOUS, ApiKeys, KeyFileError, bearer_token, load_keys, parse_key_file
from router_svc.errors import RouterError
from router_svc.validation import PreparedRequest


def _keys_file(tmp_path, text: str):
    f = tmp_path / "keys"
    f.write_text(text)
    f.chmod(0o600)
    return f


def test_key_file_tenants_comments_and_rotation(tmp_path):
    f = _keys_file(tmp_path, "# team keys\n\nalice k-alice-1\nalice k-alice-2  # rotated\n  bob   k-bob\n")
    keys = ApiKeys()
    parse_key_file(f, keys)
    assert keys.enabled and keys.tenants == ("alice", "bob")
    assert [keys.tenant_of(k) for k in ("k-alice-1", "k-alice-2", "k-bob")] == ["alice", "alice", "bob"]
    assert keys.tenant_of("k-alice") is None and keys.tenant_of("") is None and keys.tenant_of(None) is None
    assert all(b"k-" not in d for d, _ in keys.entries)   # held as digests only


def test_open_router_is_one_anonymous_tenant():
    keys = load_keys([], "", env={})
    assert not keys.enabled and keys.tenants == (ANONYMOUS,)
    assert keys.tenant_of(None) == ANONYMOUS and keys.tenant_of("anything") == ANONYMOUS


def test_flag_and_env_keys_are_tenant_default(tmp_path):
    keys = load_keys(["k1", "k2"], str(_keys_file(tmp_path, "alice ka\n")), env={"HALFMOON_API_KEY": "kenv"})
    assert keys.tenants == ("alice", "default")
    assert [keys.tenant_of(k) for k in ("k1", "k2", "kenv", "ka")] == ["default", "default", "default", "alice"]
    assert load_keys([], "", env={"HALFMOON_API_KEY": "  "}).enabled is False   # blank: not a key


@pytest.mark.parametrize("text, error", [
    ("alice k1\nbob sk-secret-xyz extra\n", ":2: expected '<tenant> <key>', got 3 field(s)"),
    ("sk-secret-xyz\n", ":1: expected '<tenant> <key>', got 1 field(s)"),
    ("a/b sk-secret-xyz\n", ":1: tenant name must match"),
    ("anonymous sk-secret-xyz\n", ":1: tenant name must match"),
    ("alice sk-secret-xyz\nbob sk-secret-xyz\n", ":2: this key is already given to tenant 'alice'"),
    ("# nothing\n\n", "holds no key"),
])
def test_bad_key_file_names_the_line_not_the_key(tmp_path, text, error):
    f = _keys_file(tmp_path, text)
    with pytest.raises(KeyFileError) as info:
        parse_key_file(f, ApiKeys())
    assert error in str(info.value) and str(f) in str(info.value)
    assert "sk-secret-xyz" not in str(info.value)


def test_unreadable_key_file(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read"):
        parse_key_file(tmp_path / "missing", ApiKeys())


@pytest.mark.parametrize("value, key", [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("BEARER abc", "abc"),
                                        ("Basic abc", None), ("abc", None), ("Bearer ", None), ("", None),
                                        (None, None)])
def test_bearer_token(value, key):
    assert bearer_token(value) == key


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    front_door.add_arguments(p)
    return p.parse_args(list(argv))


def test_front_door_flags_and_start_up_errors(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("HALFMOON_API_KEY", raising=False)
    bad = _keys_file(tmp_path, "alice sk-secret-xyz trailing\n")
    with pytest.raises(SystemExit) as info:
        front_door.FrontDoor.from_args(_args("--api-key-file", str(bad)))
    assert f"serve-router: --api-key-file {bad}:1:" in str(info.value) and "sk-secret-xyz" not in str(info.value)
    for argv in (["--rate-limit-rps", "-1"], ["--max-queued-requests", "-2"], ["--max-request-bytes", "0"]):
        with pytest.raises(SystemExit, match=argv[0]):
            front_door.FrontDoor.from_args(_args(*argv))

    caplog.set_level(logging.INFO, logger="halfmoon.router")
    door = front_door.FrontDoor.from_args(_args())
    door.log_startup()
    assert "no API key configured: the router is open" in caplog.text
    assert door.grpc_options() == [("grpc.max_receive_message_length", front_door.DEFAULT_MAX_REQUEST_BYTES)]
    caplog.clear()
    shared = _keys_file(tmp_path, "alice sk-alice-xyz\n")
    shared.chmod(0o644)
    door = front_door.FrontDoor.from_args(_args("--api-key", "sk-flag-xyz", "--api-key-file", str(shared),
                                                "--rate-limit-rps", "2.5", "--max-queued-requests", "8"))
    door.log_startup()
    assert "readable by group or others" in caplog.text
    assert "API keys required: 2 key(s), tenants alice, default; rate limit 2.5 req/s burst 3" in caplog.text
    assert "sk-alice-xyz" not in caplog.text and "sk-flag-xyz" not in caplog.text


def test_token_bucket_per_tenant_with_retry_after():
    a = Admission(rate_rps=0.5, burst=2)
    a.admit("alice").close()
    a.admit("alice").close()
    with pytest.raises(RouterError) as info:
        a.admit("alice")
    exc = info.value
    assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and exc.err_code == "rate_limit_exceeded"
    assert exc.retry_after == 2 and exc.http_status == 429 and exc.http_headers == {"Retry-After": "2"}
    assert exc.openai_body()["error"]["type"] == "requests" and exc.grpc_trailers() == (("retry-after", "2"),)
    a.admit("bob").close()     # another tenant's bucket is full
    assert Admission().admit("alice") is not None  # 0 = off


def test_admission_queue_bound_and_ticket_release():
    a = Admission(rate_rps=1, burst=1, max_queued=1)
    t = a.admit("alice")
    with pytest.raises(RouterError) as info:
        a.admit("bob")
    assert info.value.err_code == "queue_full" and info.value.retry_after == 1
    t.started()
    t.close()          # idempotent: leaves the queue once
    assert a.queued == 0
    a.admit("bob")     # the refusal took none of bob's tokens


def test_worker_request_ids_are_tenant_scoped():
    def prep(tenant):
        return PreparedRequest("req-1", [1], common_pb2.SamplingParams(), [], tenant=tenant)

    assert prep(ANONYMOUS).worker_request_id == "req-1"
    assert prep("alice").worker_request_id == "alice/req-1" != prep("bob").worker_request_id

"""Hypothesis strategies for the fuzz suite (tests/integration/test_fuzz.py): protobuf requests built
from the message descriptors, their wire bytes (mutated: invalid UTF-8, unknown fields, truncation,
garbage), and OpenAI HTTP bodies (one field of a valid body mutated, random JSON, raw bytes).

Every strategy is bounded (list sizes, string lengths, nesting) so one example stays cheap, but
reaches the edges: NaN/inf, int32/uint64 limits, negative numbers, empty and huge strings and lists.
"""

from __future__ import annotations

import json
import math
from typing import Any

from google.protobuf import message
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

F = FieldDescriptor
# Worker ids of the fuzzed stack: a fuzzed registry call must not hijack or unregister them (that is
# the registry-ownership work, tested there); everything else about the ids is fair game.
PROTECTED_IDS = ("prefill-0", "decode-0")

_INT_EDGES = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}

texts = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", " ", "\x00", "prefill-0", "decode-0", "127.0.0.1:1", "cpu", "cuda:0", "page_major",
                     "float32", "x" * 5000, "\ud7ff\U0010ffff", "../../etc/passwd", "%s%n", "🌓" * 100]),
)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    small = st.integers(max(lo, -4), min(hi, 300))
    edges = st.sampled_from(sorted({lo, hi, max(lo, -1), 0, 1, min(hi, 2**31 - 1), min(hi, 2**32 - 1),
                                    min(hi, 2**63 - 1)}))
    return st.one_of(small, edges, st.integers(lo, hi))


_floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 2.0, math.nan, math.inf,
                                                           -math.inf, 3.4e38, 1e-45]))
_doubles = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf]))


def _scalar(f: FieldDescriptor) -> st.SearchStrategy:
    if f.type in _INT_EDGES:
        return _ints(*_INT_EDGES[f.type])
    if f.type == F.TYPE_FLOAT:
        return _floats
    if f.type == F.TYPE_DOUBLE:
        return _doubles
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type == F.TYPE_STRING:
        return texts
    if f.type == F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.just(b"\x00" * 3000))
    if f.type == F.TYPE_ENUM:   # declared values and unknown ones (an open proto3 enum keeps them)
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), _ints(-2**31, 2**31 - 1))
    raise TypeError(f"no strategy for {f.full_name} (type {f.type})")


def _repeated(f: FieldDescriptor, elem: st.SearchStrategy, depth: int) -> st.SearchStrategy[list]:
    lists = st.lists(elem, max_size=6 if depth == 0 else 3)
    if f.type in _INT_EDGES:   # a huge list: prompts of 100k tokens, page-id lists past the pool
        lists = st.one_of(lists, st.builds(lambda n, v: [v] * n, st.sampled_from([1000, 100_000]), elem))
    elif f.type == F.TYPE_STRING:
        lists = st.one_of(lists, st.builds(lambda n: ["s"] * n, st.just(5000)))
    return lists


def proto_messages(desc: Descriptor, cls: type[message.Message], depth: int = 0) -> st.SearchStrategy:
    """Messages of ``cls`` (descriptor ``desc``) with any subset of their fields set, recursively
    (nested messages down to depth 3)."""
    fields = {}
    for f in desc.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:   # map<scalar, scalar>
            key, val = (f.message_type.fields_by_name[n] for n in ("key", "value"))
            fields[f.name] = st.dictionaries(_scalar(key), _scalar(val), max_size=6)
            continue
        if f.message_type is not None:
            if depth >= 3:
                continue
            elem = st.deferred(lambda f=f: proto_messages(f.message_type, _class_of(cls, f), depth + 1))
        else:
            elem = _scalar(f)
        fields[f.name] = _repeated(f, elem, depth) if f.is_repeated else elem

    def build(values: dict[str, Any]) -> message.Message:
        msg = cls()
        for name, value in values.items():
            f = desc.fields_by_name[name]
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                for k, v in value.items():
                    getattr(msg, name)[k] = v
            elif f.is_repeated:
                getattr(msg, name).extend(value)
            elif f.message_type is not None:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=fields).map(build)


def _class_of(cls: type[message.Message], f: FieldDescriptor) -> type[message.Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(f.message_type)


def _unknown_field(number: int) -> bytes:
    """A varint field ``number`` (wire type 0) holding 1: bytes no halfmoon message declares."""
    key = number << 3
    out = bytearray()
    while True:
        b = key & 0x7F
        key >>= 7
        out.append(b | (0x80 if key else 0))
        if not key:
            break
    return bytes(out) + b"\x01"


# How the serialized request is changed before it is sent, and what the answer must then be.
MUTATIONS = ("none", "invalid_utf8", "unknown_field", "truncate", "garbage")


def wire_bytes(msgs: st.SearchStrategy) -> st.SearchStrategy[tuple[str, bytes, message.Message]]:
    """(mutation, bytes on the wire, the message before mutation)."""

    @st.composite
    def build(draw):
        msg = draw(msgs)
        raw = msg.SerializeToString()
        kind = draw(st.sampled_from(MUTATIONS))
        if kind == "invalid_utf8":
            bad = draw(st.sampled_from([b"\xc3(", b"\xff", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
            strings = _string_spans(msg)
            if not strings:
                kind = "none"
            else:
                old = draw(st.sampled_from(strings))
                raw = _set_first_string(msg, old, bad)
        elif kind == "unknown_field":
            raw = raw + _unknown_field(draw(st.sampled_from([15, 99, 1000, 536870911])))
        elif kind == "truncate":
            if len(raw) < 2:
                kind = "none"
            else:
                raw = raw[:draw(st.integers(1, len(raw) - 1))]
        elif kind == "garbage":
            raw = draw(st.binary(min_size=1, max_size=64))
        return kind, raw, msg

    return build()


def _string_spans(msg: message.Message, prefix: str = "") -> list[str]:
    """Field paths (``a.b`` / ``a[0]``, top level first) of the non-repeated and repeated string
    fields set in ``msg``."""
    out = []
    for f, value in msg.ListFields():
        if f.type == F.TYPE_STRING:
            out += [f"{prefix}{f.name}[{i}]" for i in range(len(value))] if f.is_repeated else [f"{prefix}{f.name}"]
        elif f.message_type is not None and not f.message_type.GetOptions().map_entry:  # no string maps
            for i, sub in enumerate(value if f.is_repeated else [value]):
                name = f"{f.name}[{i}]" if f.is_repeated else f.name
                out += _string_spans(sub, f"{prefix}{name}.")
    return out


def _set_first_string(msg: message.Message, path: str, bad: bytes) -> bytes:
    """``msg`` serialized with the string at ``path`` replaced by a marker and the marker by ``bad``."""
    marker = "\x01\x02MARK\x02\x01"
    copy = type(msg)()
    copy.CopyFrom(msg)
    target, name, index = copy, None, None
    parts = path.split(".")
    for i, part in enumerate(parts):
        name, _, idx = part.partition("[")
        index = int(idx[:-1]) if idx else None
        if i < len(parts) - 1:
            target = getattr(target, name)[index] if index is not None else getattr(target, name)
    if index is None:
        setattr(target, name, marker)
    else:
        getattr(target, name)[index] = marker
    raw = copy.SerializeToString()
    assert raw.count(marker.encode()) == 1
    # the same length as the marker, so the length prefix stays right
    return raw.replace(marker.encode(), (bad * len(marker))[:len(marker)])


# ---- OpenAI HTTP bodies

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12)

BASES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0},
}

# A value of the wrong JSON type for each field (what a correct server must refuse naming it).
_NUM = [0.5, 1e300]
_BAD_TYPE = {
    "model": [1, [], {}, True], "max_tokens": ["2", 2.5, True, []], "temperature": ["0", True, [], {}],
    "top_p": ["1", [], True], "n": ["1", 1.5, True, 0, 17], "stream": ["true", 1, 0], "stop": [1, [1], {}, [None]],
    "seed": ["1", 1.5, True], "presence_penalty": ["0", []], "frequency_penalty": ["0", {}],
    "user": [1, [], {}], "top_k": ["1", 1.5, True], "min_p": ["0", []], "repetition_penalty": ["1", True],
    "ignore_eos": ["yes", 1], "stop_token_ids": [1, ["1"], [1.5], "x"], "request_id": [1, [], {}],
    "stream_options": ["x", 1, [], {"include_usage": "yes"}, {"bogus": True}],
    "logit_bias": ["x", 1, [], {"a": "b"}, {"1": "x"}, {"1": 500}, {"-3": 1}, {"99999999": 1}],
    "response_format": ["x", 1, [], {}, {"type": "yaml"}, {"type": "json_schema"},
                        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}],
    "best_of": ["1", 0, 17, 1.5],
}
_BAD_COMPLETION = {"prompt": [None, 1, {}, [1.5], [[None]], [["a"]], True, [1, "a"]],
                   "logprobs": ["1", 1.5, True, [], 21, -1], "echo": ["no", 1], "suffix": [1, []]}
_BAD_CHAT = {"messages": [None, "hi", {}, [None], [{"role": 1, "content": "x"}], [{"content": "x"}],
                          [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                          [{"role": "user", "content": [{"type": "image_url"}]}],
                          [{"role": "user", "content": "x", "name": 5}], [{"role": "user", "content": "x", "bogus": 1}]],
             "max_completion_tokens": ["2", 2.5, []], "logprobs": ["yes", 1], "top_logprobs": ["1", 1.5, True]}


def bad_field_values(route: str) -> dict[str, list]:
    return {**_BAD_TYPE,
            **(_BAD_COMPLETION if route == "/v1/completions" else _BAD_CHAT)}


def mutated_bodies(route: str) -> st.SearchStrategy[tuple[str, bytes, str | None]]:
    """(kind, body bytes, the one field that must be named or None)."""
    base = BASES[route]
    bad = bad_field_values(route)
    one_bad = st.sampled_from(sorted(bad)).flatmap(
        lambda k: st.sampled_from(bad[k]).map(lambda v: ("wrong_type", _dump(dict(base, **{k: v})), k)))
    unknown = texts.filter(lambda k: k not in bad and k not in base and k).map(
        lambda k: ("unknown_field", _dump(dict(base, **{k: 1})), k))
    any_value = st.tuples(st.sampled_from(sorted(set(bad) | set(base))), json_values).map(
        lambda kv: ("any_value", _dump(dict(base, **{kv[0]: kv[1]})), None))
    random_json = json_values.map(lambda v: ("random_json", _dump(v), None))
    raw = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{", b"[]", b"null", b'{"prompt": "\xff\xfe"}',
                                                             b'{"messages": "\xc3("}', b'{"temperature": NaN}',
                                                             b'{"max_tokens": Infinity}', b"{" * 5000])
                    ).map(lambda b: ("raw", b, None))
    return st.one_of(one_bad, unknown, any_value, random_json, raw)


def _dump(value: Any) -> bytes:
    # allow_nan: NaN / Infinity tokens are what a sloppy client sends; the server must refuse them
    return json.dumps(value, allow_nan=True).encode()

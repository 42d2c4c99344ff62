from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "logit_bias", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "ebnf")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    ebnf: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "room", "reason", "sample")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    room: int
    reason: str
    sample: int
    def __init__(self, request_id: _Optional[str] = ..., room: _Optional[int] = ..., reason: _Optional[str] = ..., sample: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("per_rank",)
    PER_RANK_FIELD_NUMBER: _ClassVar[int]
    per_rank: bool
    def __init__(self, per_rank: _Optional[bool] = ...) -> None: ...

class KVAccounting(_message.Message):
    __slots__ = ("total_pages", "free_pages", "evictable_pages", "locked_pages", "owned_pages", "min_lock_ref", "held_rooms", "held_req_slots")
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOCKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    OWNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    MIN_LOCK_REF_FIELD_NUMBER: _ClassVar[int]
    HELD_ROOMS_FIELD_NUMBER: _ClassVar[int]
    HELD_REQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    total_pages: int
    free_pages: int
    evictable_pages: int
    locked_pages: int
    owned_pages: int
    min_lock_ref: int
    held_rooms: int
    held_req_slots: int
    def __init__(self, total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., locked_pages: _Optional[int] = ..., owned_pages: _Optional[int] = ..., min_lock_ref: _Optional[int] = ..., held_rooms: _Optional[int] = ..., held_req_slots: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("worker_id", "waiting_requests", "running_requests", "transferring_requests", "kv_usage", "accounting", "ranks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTING_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    waiting_requests: int
    running_requests: int
    transferring_requests: int
    kv_usage: float
    accounting: KVAccounting
    ranks: _containers.RepeatedCompositeFieldContainer[RankAccounting]
    def __init__(self, worker_id: _Optional[str] = ..., waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., transferring_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., accounting: _Optional[_Union[KVAccounting, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankAccounting, _Mapping]]] = ...) -> None: ...

class RankAccounting(_message.Message):
    __slots__ = ("rank", "pool_pages", "batches", "table_rows", "table_crc")
    RANK_FIELD_NUMBER: _ClassVar[int]
    POOL_PAGES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    TABLE_CRC_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pool_pages: int
    batches: int
    table_rows: int
    table_crc: int
    def __init__(self, rank: _Optional[int] = ..., pool_pages: _Optional[int] = ..., batches: _Optional[int] = ..., table_rows: _Optional[int] = ..., table_crc: _Optional[int] = ...) -> None: ...

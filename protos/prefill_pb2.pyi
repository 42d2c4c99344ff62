from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "room", "input_ids", "sampling", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    room: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    n: int
    def __init__(self, request_id: _Optional[str] = ..., room: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("room", "decode_segment", "dst_page_ids", "pre_len", "prompt_len", "want_checksums", "decode_worker_id", "write_deadline_ms", "prefill_incarnation")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PRE_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    WANT_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WRITE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    room: int
    decode_segment: str
    dst_page_ids: _containers.RepeatedScalarFieldContainer[int]
    pre_len: int
    prompt_len: int
    want_checksums: bool
    decode_worker_id: str
    write_deadline_ms: int
    prefill_incarnation: str
    def __init__(self, room: _Optional[int] = ..., decode_segment: _Optional[str] = ..., dst_page_ids: _Optional[_Iterable[int]] = ..., pre_len: _Optional[int] = ..., prompt_len: _Optional[int] = ..., want_checksums: _Optional[bool] = ..., decode_worker_id: _Optional[str] = ..., write_deadline_ms: _Optional[int] = ..., prefill_incarnation: _Optional[str] = ...) -> None: ...

class SetDestinationResponse(_message.Message):
    __slots__ = ("prefill_segment", "incarnation", "write_deadline_ms")
    PREFILL_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WRITE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    prefill_segment: str
    incarnation: str
    write_deadline_ms: int
    def __init__(self, prefill_segment: _Optional[str] = ..., incarnation: _Optional[str] = ..., write_deadline_ms: _Optional[int] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("room", "first_token_id", "first_logprob", "cached_tokens", "pages_sent", "bytes_sent", "queue_seconds", "prefill_seconds", "transfer_seconds")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    room: int
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    pages_sent: int
    bytes_sent: int
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    def __init__(self, room: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., pages_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...

class FirstSample(_message.Message):
    __slots__ = ("token_id", "logprob", "sampler_state")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    sampler_state: bytes
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., sampler_state: _Optional[bytes] = ...) -> None: ...

class KVNotice(_message.Message):
    __slots__ = ("room", "ok", "error", "first_token_id", "first_logprob", "cached_tokens", "pages_sent", "sampler_state", "samples", "head_checksums", "head_block_cuts")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HEAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    HEAD_BLOCK_CUTS_FIELD_NUMBER: _ClassVar[int]
    room: int
    ok: bool
    error: str
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    cached_tokens: int
    pages_sent: int
    sampler_state: bytes
    samples: _containers.RepeatedCompositeFieldContainer[FirstSample]
    head_checksums: _containers.RepeatedScalarFieldContainer[int]
    head_block_cuts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, room: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., pages_sent: _Optional[int] = ..., sampler_state: _Optional[bytes] = ..., samples: _Optional[_Iterable[_Union[FirstSample, _Mapping]]] = ..., head_checksums: _Optional[_Iterable[int]] = ..., head_block_cuts: _Optional[_Iterable[int]] = ...) -> None: ...

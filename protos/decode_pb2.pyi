from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "room", "input_ids", "sampling", "prefill_address", "prefill_worker_id", "local_prefill", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    room: int
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    prefill_worker_id: str
    local_prefill: bool
    n: int
    def __init__(self, request_id: _Optional[str] = ..., room: _Optional[int] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., local_prefill: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "matched_stop", "prompt_tokens", "cached_tokens", "decode_prefix_tokens", "kv_pages_transferred", "kv_bytes_transferred", "completion_tokens", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: str
    matched_stop: str
    prompt_tokens: int
    cached_tokens: int
    decode_prefix_tokens: int
    kv_pages_transferred: int
    kv_bytes_transferred: int
    completion_tokens: int
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., matched_stop: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., decode_prefix_tokens: _Optional[int] = ..., kv_pages_transferred: _Optional[int] = ..., kv_bytes_transferred: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

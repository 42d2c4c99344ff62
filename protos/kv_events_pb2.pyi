from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ("incarnation", "after_seq")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    after_seq: int
    def __init__(self, incarnation: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class KVPageRun(_message.Message):
    __slots__ = ("kind", "page_hashes", "parent_hash", "token_start")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORED: _ClassVar[KVPageRun.Kind]
        REMOVED: _ClassVar[KVPageRun.Kind]
    STORED: KVPageRun.Kind
    REMOVED: KVPageRun.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    kind: KVPageRun.Kind
    page_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    token_start: int
    def __init__(self, kind: _Optional[_Union[KVPageRun.Kind, str]] = ..., page_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., token_start: _Optional[int] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("incarnation", "seq", "snapshot", "runs", "page_size", "worker_id")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    seq: int
    snapshot: bool
    runs: _containers.RepeatedCompositeFieldContainer[KVPageRun]
    page_size: int
    worker_id: str
    def __init__(self, incarnation: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., runs: _Optional[_Iterable[_Union[KVPageRun, _Mapping]]] = ..., page_size: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

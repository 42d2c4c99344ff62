from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    PREFILL: _ClassVar[WorkerRole]
    DECODE: _ClassVar[WorkerRole]
ROLE_UNSPECIFIED: WorkerRole
PREFILL: WorkerRole
DECODE: WorkerRole

class MemoryRegion(_message.Message):
    __slots__ = ("base", "length", "rkey", "location", "rank", "kv_head_start", "kv_head_end", "worker_address", "pid", "pid_start_ticks")
    BASE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    base: int
    length: int
    rkey: bytes
    location: str
    rank: int
    kv_head_start: int
    kv_head_end: int
    worker_address: bytes
    pid: int
    pid_start_ticks: int
    def __init__(self, base: _Optional[int] = ..., length: _Optional[int] = ..., rkey: _Optional[bytes] = ..., location: _Optional[str] = ..., rank: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., worker_address: _Optional[bytes] = ..., pid: _Optional[int] = ..., pid_start_ticks: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("layout", "num_layers", "page_size", "num_pages", "kv_heads", "head_dim", "dtype", "buffer_addrs", "page_bytes", "page_stride_bytes", "model", "tp_size", "max_context")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ADDRS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    layout: str
    num_layers: int
    page_size: int
    num_pages: int
    kv_heads: int
    head_dim: int
    dtype: str
    buffer_addrs: _containers.RepeatedScalarFieldContainer[int]
    page_bytes: int
    page_stride_bytes: int
    model: str
    tp_size: int
    max_context: int
    def __init__(self, layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., buffer_addrs: _Optional[_Iterable[int]] = ..., page_bytes: _Optional[int] = ..., page_stride_bytes: _Optional[int] = ..., model: _Optional[str] = ..., tp_size: _Optional[int] = ..., max_context: _Optional[int] = ...) -> None: ...

class SegmentDescriptor(_message.Message):
    __slots__ = ("name", "incarnation", "worker_address", "regions", "kv_layout", "host_id", "pid", "pid_start_ticks", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_START_TICKS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    incarnation: str
    worker_address: bytes
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    kv_layout: KVLayout
    host_id: str
    pid: int
    pid_start_ticks: int
    digest: bytes
    def __init__(self, name: _Optional[str] = ..., incarnation: _Optional[str] = ..., worker_address: _Optional[bytes] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., kv_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., host_id: _Optional[str] = ..., pid: _Optional[int] = ..., pid_start_ticks: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class WorkerRecord(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "metrics_address", "model", "segment")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    grpc_address: str
    metrics_address: str
    model: str
    segment: SegmentDescriptor
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., grpc_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., model: _Optional[str] = ..., segment: _Optional[_Union[SegmentDescriptor, _Mapping]] = ...) -> None: ...

class RegisterSegmentRequest(_message.Message):
    __slots__ = ("worker", "ttl_seconds", "lease_secret")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerRecord
    ttl_seconds: int
    lease_secret: str
    def __init__(self, worker: _Optional[_Union[WorkerRecord, _Mapping]] = ..., ttl_seconds: _Optional[int] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class RegisterSegmentResponse(_message.Message):
    __slots__ = ("lease_id", "ttl_seconds", "lease_secret")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_seconds: int
    lease_secret: str
    def __init__(self, lease_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class GetSegmentRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetSegmentResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerRecord
    def __init__(self, worker: _Optional[_Union[WorkerRecord, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "lease_secret")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    lease_secret: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    def __init__(self, ttl_seconds: _Optional[int] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "lease_secret")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECRET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    lease_secret: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_secret: _Optional[str] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("kind", "worker", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WorkerEvent.Kind]
        ADDED: _ClassVar[WorkerEvent.Kind]
        REMOVED: _ClassVar[WorkerEvent.Kind]
        UPDATED: _ClassVar[WorkerEvent.Kind]
    KIND_UNSPECIFIED: WorkerEvent.Kind
    ADDED: WorkerEvent.Kind
    REMOVED: WorkerEvent.Kind
    UPDATED: WorkerEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: WorkerEvent.Kind
    worker: WorkerRecord
    reason: str
    def __init__(self, kind: _Optional[_Union[WorkerEvent.Kind, str]] = ..., worker: _Optional[_Union[WorkerRecord, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class StoredWorker(_message.Message):
    __slots__ = ("worker", "secret_sha256", "ttl_seconds")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SECRET_SHA256_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerRecord
    secret_sha256: bytes
    ttl_seconds: int
    def __init__(self, worker: _Optional[_Union[WorkerRecord, _Mapping]] = ..., secret_sha256: _Optional[bytes] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

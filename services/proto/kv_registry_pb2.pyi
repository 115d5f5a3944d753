from services.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_DEVICE: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_BOTH: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_DEVICE: KvTier
KV_TIER_HOST: KvTier
KV_TIER_DISK: KvTier

class RequestLimits(_message.Message):
    __slots__ = ("max_model_len", "max_n")
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    max_model_len: int
    max_n: int
    def __init__(self, max_model_len: _Optional[int] = ..., max_n: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "role", "model", "incarnation", "block_size", "hash_name", "limits", "kv_capacity_blocks", "registration_nonce")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_NAME_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_NONCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: WorkerRole
    model: str
    incarnation: str
    block_size: int
    hash_name: str
    limits: RequestLimits
    kv_capacity_blocks: int
    registration_nonce: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., incarnation: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_name: _Optional[str] = ..., limits: _Optional[_Union[RequestLimits, _Mapping]] = ..., kv_capacity_blocks: _Optional[int] = ..., registration_nonce: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerInfo
    def __init__(self, worker: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("ttl_s", "incarnation")
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ttl_s: int
    incarnation: str
    def __init__(self, ttl_s: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    load: _common_pb2.WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("needs_full_dump",)
    NEEDS_FULL_DUMP_FIELD_NUMBER: _ClassVar[int]
    needs_full_dump: bool
    def __init__(self, needs_full_dump: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: KvTier
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishEventsRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class PublishEventsResponse(_message.Message):
    __slots__ = ("last_seq", "needs_full_dump")
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FULL_DUMP_FIELD_NUMBER: _ClassVar[int]
    last_seq: int
    needs_full_dump: bool
    def __init__(self, last_seq: _Optional[int] = ..., needs_full_dump: _Optional[bool] = ...) -> None: ...

class TierBlocks(_message.Message):
    __slots__ = ("tier", "block_hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: KvTier
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, tier: _Optional[_Union[KvTier, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReportBlocksRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "seq", "tiers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    seq: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierBlocks]
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., seq: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierBlocks, _Mapping]]] = ...) -> None: ...

class ReportBlocksResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("matched_blocks", "unknown_workers", "host_blocks", "disk_blocks")
    class MatchedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class HostBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DiskBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matched_blocks: _containers.ScalarMap[str, int]
    unknown_workers: _containers.RepeatedScalarFieldContainer[str]
    host_blocks: _containers.ScalarMap[str, int]
    disk_blocks: _containers.ScalarMap[str, int]
    def __init__(self, matched_blocks: _Optional[_Mapping[str, int]] = ..., unknown_workers: _Optional[_Iterable[str]] = ..., host_blocks: _Optional[_Mapping[str, int]] = ..., disk_blocks: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[LiveWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[LiveWorker, _Mapping]]] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchWorkersResponse(_message.Message):
    __slots__ = ("reset", "updated", "removed", "resync_s")
    RESET_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_S_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    updated: _containers.RepeatedCompositeFieldContainer[LiveWorker]
    removed: _containers.RepeatedScalarFieldContainer[str]
    resync_s: float
    def __init__(self, reset: _Optional[bool] = ..., updated: _Optional[_Iterable[_Union[LiveWorker, _Mapping]]] = ..., removed: _Optional[_Iterable[str]] = ..., resync_s: _Optional[float] = ...) -> None: ...

class LiveWorker(_message.Message):
    __slots__ = ("info", "load")
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    load: _common_pb2.WorkerLoad
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class GetMeshConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMeshConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: _common_pb2.MeshConfig
    def __init__(self, config: _Optional[_Union[_common_pb2.MeshConfig, _Mapping]] = ...) -> None: ...

class PurgeExpiredRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PurgeExpiredResponse(_message.Message):
    __slots__ = ("worker_ids",)
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

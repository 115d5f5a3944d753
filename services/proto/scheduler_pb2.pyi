from services.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes", "num_prompt_tokens", "dry_run", "model", "exclude_addresses", "max_tokens", "n", "avoid_addresses")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    AVOID_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    dry_run: bool
    model: str
    exclude_addresses: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    n: int
    avoid_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., dry_run: _Optional[bool] = ..., model: _Optional[str] = ..., exclude_addresses: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., n: _Optional[int] = ..., avoid_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("decode_address", "prefill_address", "cached_blocks", "scores", "prefill_reason", "decode_worker_id", "prefill_worker_id", "unknown_workers", "kv_source")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    prefill_address: str
    cached_blocks: int
    scores: _containers.ScalarMap[str, float]
    prefill_reason: str
    decode_worker_id: str
    prefill_worker_id: str
    unknown_workers: _containers.RepeatedScalarFieldContainer[str]
    kv_source: _common_pb2.KvSource
    def __init__(self, decode_address: _Optional[str] = ..., prefill_address: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., scores: _Optional[_Mapping[str, float]] = ..., prefill_reason: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., unknown_workers: _Optional[_Iterable[str]] = ..., kv_source: _Optional[_Union[_common_pb2.KvSource, _Mapping]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("placements", "by_prefill_reason", "by_worker", "refused", "by_policy_branch")
    class ByPrefillReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ByPolicyBranchEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    BY_PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    BY_POLICY_BRANCH_FIELD_NUMBER: _ClassVar[int]
    placements: int
    by_prefill_reason: _containers.ScalarMap[str, int]
    by_worker: _containers.ScalarMap[str, int]
    refused: int
    by_policy_branch: _containers.ScalarMap[str, int]
    def __init__(self, placements: _Optional[int] = ..., by_prefill_reason: _Optional[_Mapping[str, int]] = ..., by_worker: _Optional[_Mapping[str, int]] = ..., refused: _Optional[int] = ..., by_policy_branch: _Optional[_Mapping[str, int]] = ...) -> None: ...

class SchedulerServiceGetMeshConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerServiceGetMeshConfigResponse(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: _common_pb2.MeshConfig
    def __init__(self, config: _Optional[_Union[_common_pb2.MeshConfig, _Mapping]] = ...) -> None: ...

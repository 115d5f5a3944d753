from services.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KvTransport]
    KV_TRANSPORT_SHARED_MEMORY: _ClassVar[KvTransport]
    KV_TRANSPORT_GRPC_STREAM: _ClassVar[KvTransport]
KV_TRANSPORT_UNSPECIFIED: KvTransport
KV_TRANSPORT_SHARED_MEMORY: KvTransport
KV_TRANSPORT_GRPC_STREAM: KvTransport

class ExecuteRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "cache_salt", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    kv_source: _common_pb2.KvSource
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., kv_source: _Optional[_Union[_common_pb2.KvSource, _Mapping]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("update",)
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    update: TokenUpdate
    def __init__(self, update: _Optional[_Union[TokenUpdate, _Mapping]] = ...) -> None: ...

class TokenUpdate(_message.Message):
    __slots__ = ("sample_index", "index", "token_ids", "logprobs", "finish_reason", "cached_prompt_tokens")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    cached_prompt_tokens: int
    def __init__(self, sample_index: _Optional[int] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _common_pb2.WorkerLoad
    def __init__(self, load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "decode_address", "transport", "cache_salt", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    decode_address: str
    transport: KvTransport
    cache_salt: str
    kv_source: _common_pb2.KvSource
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., transport: _Optional[_Union[KvTransport, str]] = ..., cache_salt: _Optional[str] = ..., kv_source: _Optional[_Union[_common_pb2.KvSource, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logprob", "finish_reason", "cached_prompt_tokens", "kv_handle", "kv_bytes")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: float
    finish_reason: _common_pb2.FinishReason
    cached_prompt_tokens: int
    kv_handle: str
    kv_bytes: int
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., cached_prompt_tokens: _Optional[int] = ..., kv_handle: _Optional[str] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class KvHeader(_message.Message):
    __slots__ = ("handle", "request_id", "shape", "dtype", "num_bytes", "shm_name", "lease_ms", "prompt_digest", "shm_token")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    handle: str
    request_id: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    num_bytes: int
    shm_name: str
    lease_ms: int
    prompt_digest: bytes
    shm_token: bytes
    def __init__(self, handle: _Optional[str] = ..., request_id: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., num_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., lease_ms: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ..., shm_token: _Optional[bytes] = ...) -> None: ...

class PushKvRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("handle", "num_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: str
    num_bytes: int
    def __init__(self, handle: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class FetchKvRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchKvResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "first_token", "first_logprob", "kv_handle", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    first_token: int
    first_logprob: float
    kv_handle: str
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token: _Optional[int] = ..., first_logprob: _Optional[float] = ..., kv_handle: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("update",)
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    update: TokenUpdate
    def __init__(self, update: _Optional[_Union[TokenUpdate, _Mapping]] = ...) -> None: ...

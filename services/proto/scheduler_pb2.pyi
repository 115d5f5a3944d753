from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "block_hashes", "num_prompt_tokens", "dry_run")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    num_prompt_tokens: int
    dry_run: bool
    def __init__(self, request_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., num_prompt_tokens: _Optional[int] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("decode_address", "prefill_address", "cached_blocks", "scores")
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
    decode_address: str
    prefill_address: str
    cached_blocks: int
    scores: _containers.ScalarMap[str, float]
    def __init__(self, decode_address: _Optional[str] = ..., prefill_address: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., scores: _Optional[_Mapping[str, float]] = ...) -> None: ...

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetRuntimeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRuntimeStatsResponse(_message.Message):
    __slots__ = ("asyncio_tasks", "threads", "open_fds", "rss_bytes")
    ASYNCIO_TASKS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FDS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    asyncio_tasks: int
    threads: int
    open_fds: int
    rss_bytes: int
    def __init__(self, asyncio_tasks: _Optional[int] = ..., threads: _Optional[int] = ..., open_fds: _Optional[int] = ..., rss_bytes: _Optional[int] = ...) -> None: ...

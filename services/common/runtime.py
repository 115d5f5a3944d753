"""RuntimeService: a process's live counts (asyncio tasks, threads, open fds, RSS),
served by every Kervan gRPC server so that leak checks (the chaos soak) and
operators can watch them."""

from __future__ import annotations

import asyncio
import os
import resource
import threading
from typing import Any

import grpc

from services.proto import runtime_pb2, runtime_pb2_grpc

SERVICE_NAME = runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak instead
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class RuntimeServicer(runtime_pb2_grpc.RuntimeServiceServicer):
    async def GetRuntimeStats(self, request: runtime_pb2.GetRuntimeStatsRequest,
                              context: grpc.aio.ServicerContext[Any, Any]) -> runtime_pb2.GetRuntimeStatsResponse:
        return runtime_pb2.GetRuntimeStatsResponse(
            asyncio_tasks=len([t for t in asyncio.all_tasks() if not t.done()]), threads=threading.active_count(),
            open_fds=open_fds(), rss_bytes=rss_bytes())

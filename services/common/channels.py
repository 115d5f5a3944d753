"""One pool of channels to workers by address, for every service that dials them (the
router to run requests, a prefill worker to push KV).

A mesh's workers come and go, and each new address would otherwise keep a channel
for ever: past ``max_channels`` the least recently used one is closed, after
``close_grace_s`` for the calls still on it (None: at once, cancelling them). A
caller that knows an address has left (``discard``) closes its channel at once."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import grpc

from services.common.security import PLAINTEXT, MeshSecurity

Stub = TypeVar("Stub")


class ChannelPool(Generic[Stub]):
    def __init__(self, make_stub: Callable[[grpc.aio.Channel], Stub], security: MeshSecurity = PLAINTEXT,
                 options: Sequence[tuple[str, object]] = (), role: str | None = "worker", max_channels: int = 1024,
                 close_grace_s: float | None = None):
        if max_channels < 1:
            raise ValueError("max_channels must be at least 1")
        self.make_stub = make_stub
        self.security = security
        self.options = list(options)
        self.role = role
        self.max_channels = max_channels
        self.close_grace_s = close_grace_s
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, Stub]] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def stub(self, address: str) -> Stub:
        """The stub for ``address``, its channel opened on first use (a running event loop
        is needed when the pool is full: the evicted channel closes on it)."""
        if address in self._channels:
            self._channels.move_to_end(address)
            return self._channels[address][1]
        channel = self.security.channel(address, self.options, role=self.role)
        self._channels[address] = (channel, self.make_stub(channel))
        while len(self._channels) > self.max_channels:
            _, (old, _) = self._channels.popitem(last=False)
            self._close_later(old)
        return self._channels[address][1]

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(self.close_grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def discard(self, address: str) -> None:
        """Close the channel to a peer that left (nothing if there is none)."""
        entry = self._channels.pop(address, None)
        if entry is not None:
            await entry[0].close()

    def addresses(self) -> list[str]:
        """The addresses with an open channel, least recently used first."""
        return list(self._channels)

    def __len__(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        """Close every channel, and wait for the evicted ones still closing."""
        channels = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(channel.close() for channel in channels), *self._closing)

"""A small asyncio TCP proxy for chaos tests: it forwards a port to a target and,
on command, resets every connection (RST), blackholes them (keeps them open and
drops every byte, both ways) or delays every chunk by ``delay_s`` (a slow link or
an overloaded server). Loopback only."""

from __future__ import annotations

import asyncio
import socket
import struct


class FaultProxy:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.mode = "pass"  # "pass" | "blackhole" | "delay"
        self.delay_s = 0.0
        self.port = 0
        self._server: asyncio.base_events.Server | None = None
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._pairs.append(pair)
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)
        if pair in self._pairs:
            self._pairs.remove(pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.mode == "delay":
                    await asyncio.sleep(self.delay_s)
                if self.mode != "blackhole":
                    writer.write(data)
                    await writer.drain()
        finally:
            writer.close()

    def reset(self) -> None:
        """Abort every connection with a TCP RST (the peer sees 'connection reset')."""
        for a, b in self._pairs:
            for w in (a, b):
                if w.transport.is_closing():
                    continue
                sock = w.get_extra_info("socket")
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
                w.transport.abort()
        self._pairs.clear()

    async def stop(self) -> None:
        self.reset()
        self._server.close()
        await self._server.wait_closed()

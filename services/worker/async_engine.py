"""Drives the synchronous ``Engine`` from its own thread for asyncio callers.

The engine is not thread-safe and a step can take hundreds of milliseconds, so
it must neither run on the event loop nor be touched from it. Every call goes
through an inbox the engine thread drains between steps; outputs come back to
each request's asyncio queue via ``call_soon_threadsafe``.

    event loop                         engine thread
    generate() --add-->  inbox  --->   add_request
    abort()    --abort-> inbox  --->   abort          (one dataclass per command:
    call(fn)   --call--> inbox  --->   fn(engine)      _Add, _Abort, _Call)
    queue.get() <--call_soon_threadsafe--  step() outputs"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from services.common.errors import Overloaded, Unavailable
from services.common.load import Load
from worker import Engine, EngineStats, InvalidRequest, RequestLimits, RequestOutput, SamplingParams
from worker.parallel.group import GroupFailed

log = logging.getLogger(__name__)
T = TypeVar("T")


def _merge(earlier: RequestOutput, later: RequestOutput | Exception) -> RequestOutput | Exception:
    """``later`` carrying the new tokens of both (outputs hold full token lists already)."""
    if isinstance(later, Exception):
        return later
    before = {c.index: c.new_token_ids for c in earlier.outputs}
    for c in later.outputs:
        c.new_token_ids = before.get(c.index, []) + c.new_token_ids
    return later


def _fan_out(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue_, item in batch:
        queue_.put_nowait(item)


def _settle(future: asyncio.Future, result: object, exc: Exception | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


# What the event loop asks of the engine thread, one record per kind of command.
@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: _Stream
    options: dict


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[Engine], object]
    loop: asyncio.AbstractEventLoop | None = None  # with ``future``: whoever awaits the result
    future: asyncio.Future | None = None


_Command = _Add | _Abort | _Call


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int | None = None,
                 on_group_failed: Callable[[GroupFailed], None] | None = None):
        """``max_waiting``: requests admitted beyond a full batch (``max_num_seqs``)
        before new ones are refused with ``Overloaded``; None: no limit.
        ``on_group_failed``: called on the engine thread when a rank of the engine's
        worker group died or hangs, after every request in flight failed (a worker
        process exits: the mesh then sees one dead worker); None: the engine thread ends."""
        self.engine = engine
        self.on_group_failed = on_group_failed
        self.max_requests = 0 if max_waiting is None else engine.config.max_num_seqs + max_waiting  # 0: no limit
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._active: set[str] = set()  # event loop only: ids in flight, for duplicate checks
        self._stopped = False
        self.num_aborted = 0  # engine thread writes, anyone reads: requests aborted before they finished
        self._stats = engine.stats()  # as of the engine thread's last step
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """Step on a thread of its own (tests, embedding); a worker process calls ``run``."""
        self._thread.start()

    def run(self) -> None:
        """Step on the calling thread until ``request_stop``."""
        self._run()

    def request_stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def stop(self) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams, **options
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; leaving early aborts it.
        ``options`` go to ``Engine.add_request`` (``hold_kv``, ``imported``)."""
        if request_id in self._active:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight")
        # fail fast, in the caller's task (it reads configuration only: safe off the engine thread)
        self.engine.validate(prompt, params)
        if self.load().full:
            raise Overloaded(f"this worker has {len(self._active)} requests in flight, its limit "
                             f"(max_num_seqs + max_waiting); retry later or elsewhere")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._active.add(request_id)
        self._post(_Add(request_id, prompt, params, stream, options))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                while not isinstance(item, Exception) and not stream.queue.empty():
                    item = _merge(item, stream.queue.get_nowait())  # the reader fell behind: one update
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._active.discard(request_id)
            if not finished:
                self._post(_Abort(request_id))

    def abort(self, request_id: str) -> bool:
        known = request_id in self._active
        self._post(_Abort(request_id))
        return known

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Run ``fn(engine)`` on the engine thread between steps, without waiting for it."""
        self._post(_Call(fn))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread, between steps."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(_Call(fn, loop, future))
        return await future

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def limits(self) -> RequestLimits:
        return self.engine.limits

    def stats(self) -> EngineStats:
        """The engine's stats as of its thread's last step (safe from any thread)."""
        return self._stats

    def load(self) -> Load:
        """The load as of the engine thread's last step, with the requests admitted now."""
        stats = self._stats
        return Load(num_running=stats.num_running, num_waiting=stats.num_waiting,
                    num_free_blocks=stats.num_free_blocks, num_blocks=stats.num_blocks,
                    num_prefill_tokens=stats.num_prefill_tokens, num_evictable_blocks=stats.num_evictable_blocks,
                    num_requests=len(self._active), max_requests=self.max_requests, num_aborted=self.num_aborted,
                    expert_tokens_per_rank=stats.expert_tokens_per_rank)

    def _post(self, command: _Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                try:
                    self.engine.keepalive()  # a worker group's peers hear from rank 0 at least every second
                except GroupFailed as exc:
                    self._group_failed(exc)
                    return
                continue
            try:
                outputs = self.engine.step()
            except GroupFailed as exc:
                self._group_failed(exc)
                return
            except Exception as exc:  # a bug, not a bad request: fail what is in flight, keep serving
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self._deliver(rid, exc)
                    self.engine.abort(rid)
                continue
            self._deliver_all([(out.request_id, out) for out in outputs])

    def _group_failed(self, exc: GroupFailed) -> None:
        log.critical("%s", exc)
        for rid in list(self._streams):
            self._deliver(rid, Unavailable(f"this worker is lost: {exc}"))
        self._stopped = True
        if self.on_group_failed is not None:
            self.on_group_failed(exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self.num_aborted += self.engine.abort(command.request_id)
                self._streams.pop(command.request_id, None)
            elif isinstance(command, _Call):
                self._call(command)
            else:
                raise TypeError(f"unknown engine command {command!r}")  # a bug: never taken for an abort

    def _add(self, command: _Add) -> None:
        self._streams[command.request_id] = command.stream
        try:
            self.engine.add_request(command.prompt, command.params, request_id=command.request_id,
                                    **command.options)
        except Exception as exc:
            self._deliver(command.request_id, exc)

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as exc:
            if command.future is None:
                log.exception("posted engine call failed")
            else:
                command.loop.call_soon_threadsafe(_settle, command.future, None, exc)
        else:
            if command.future is not None:
                command.loop.call_soon_threadsafe(_settle, command.future, result, None)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        """Hand a step's outputs over with one wake-up of each event loop, not one per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(item, Exception) or item.finished:
                del self._streams[request_id]
            batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_fan_out, batch)

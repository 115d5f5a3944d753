"""Drives the synchronous ``Engine`` from its own thread for asyncio callers.

The engine is not thread-safe and a step can take hundreds of milliseconds, so
it must neither run on the event loop nor be touched from it. Every call goes
through an inbox the engine thread drains between steps; outputs come back to
each request's asyncio queue via ``call_soon_threadsafe``.

    event loop                         engine thread
    generate() --add-->  inbox  --->   add_request
    abort()    --abort-> inbox  --->   abort          (one dataclass per command:
    call(fn)   --call--> inbox  --->   fn(engine)      _Add, _Abort, _Call)
    queue.get() <--call_soon_threadsafe--  step() outputs

``health()`` says whether the engine still serves: not when its thread died, when
``max_step_failures`` steps in a row failed (every request in them failed too: a
worker in that state only looks idle and attracts placements), or when its thread
has shown no sign of life for ``wedge_timeout_s`` (a step that never returns).
The worker leaves the mesh on that answer (``membership.py``)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from services.common.errors import Overloaded, Unavailable
from services.common.load import Load
from services.worker import metrics
from services.worker.link_meter import LinkMeter
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
                 on_group_failed: Callable[[GroupFailed], None] | None = None, max_step_failures: int = 3,
                 wedge_timeout_s: float = 120.0):
        """``max_waiting``: sequences admitted beyond a full batch (``max_num_seqs``)
        before new requests are refused with ``Overloaded``; a request counts its ``n``
        samples (each a sequence of the batch); None: no limit.
        ``on_group_failed``: called on the engine thread when a rank of the engine's
        worker group died or hangs, after every request in flight failed (a worker
        process exits: the mesh then sees one dead worker); None: the engine thread ends."""
        self.engine = engine
        self.on_group_failed = on_group_failed
        self.max_requests = 0 if max_waiting is None else engine.config.max_num_seqs + max_waiting  # 0: no limit
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._active: dict[str, int] = {}  # event loop only: ids in flight -> their samples (n)
        self._stopped = False
        self.num_aborted = 0  # engine thread writes, anyone reads: requests aborted before they finished
        self._stats = engine.stats()  # as of the engine thread's last step
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.max_step_failures = max_step_failures
        self.wedge_timeout_s = wedge_timeout_s
        self._failures = 0  # engine steps in a row that failed
        self._alive_at: float | None = None  # the engine thread's last sign of life (None: not running)
        self._dead: str | None = None  # why the engine thread ended, if it ended unasked
        self.link = LinkMeter()  # what the worker's KV transfers measured of its links (its load reports it)

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
        ``options`` go to ``Engine.add_request`` (``hold_kv``, ``imported``, ``fetched``)."""
        if request_id in self._active:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight")
        # fail fast, in the caller's task (it reads configuration only: safe off the engine thread)
        self.engine.validate(prompt, params)
        in_flight = self.num_sequences
        if self.max_requests and in_flight + params.n > self.max_requests:
            raise Overloaded(f"this worker has {in_flight} sequences in flight and this request adds {params.n}; "
                             f"its limit is {self.max_requests} (max_num_seqs + max_waiting): retry later or elsewhere")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._active[request_id] = params.n
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
            self._active.pop(request_id, None)
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

    @property
    def num_sequences(self) -> int:
        """Samples of the requests in flight: what admission and the registry count."""
        return sum(self._active.values())

    def health(self) -> str | None:
        """None while the engine serves; else why it does not."""
        if self._dead is not None:
            return self._dead
        if self._failures >= self.max_step_failures:
            return f"{self._failures} engine steps in a row failed"
        alive_at = self._alive_at
        if alive_at is not None and time.monotonic() - alive_at > self.wedge_timeout_s:
            return f"the engine thread has not finished a step for {time.monotonic() - alive_at:.0f}s (wedged)"
        return None

    def load(self) -> Load:
        """The load as of the engine thread's last step, with the requests admitted now."""
        stats = self._stats
        return Load(num_running=stats.num_running, num_waiting=stats.num_waiting,
                    num_free_blocks=stats.num_free_blocks, num_blocks=stats.num_blocks,
                    num_prefill_tokens=stats.num_prefill_tokens, num_evictable_blocks=stats.num_evictable_blocks,
                    num_requests=self.num_sequences, max_requests=self.max_requests, num_aborted=self.num_aborted,
                    expert_tokens_per_rank=stats.expert_tokens_per_rank,
                    prefill_tokens_per_s=int(stats.prefill_tokens_per_s),
                    kv_link_bytes_per_s=int(self.link.bytes_per_s), kv_block_bytes=stats.kv_block_bytes,
                    num_host_blocks=stats.num_host_blocks, num_disk_blocks=stats.num_disk_blocks)

    def _post(self, command: _Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 (the thread is gone: say so, fail what is in flight)
            self._dead = f"the engine thread died: {type(exc).__name__}: {exc}"
            log.critical("%s", self._dead, exc_info=True)
            for rid in list(self._streams):
                self._deliver(rid, Unavailable(f"this worker is lost: {self._dead}"))
        finally:
            self._alive_at = None

    def _loop(self) -> None:
        while not self._stopped:
            self._alive_at = time.monotonic()
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
                start = time.perf_counter()
                outputs = self.engine.step()
                metrics.ENGINE_STEP_TIME.observe(time.perf_counter() - start)
            except GroupFailed as exc:
                self._group_failed(exc)
                return
            except Exception as exc:  # a bug, not a bad request: fail what is in flight, keep serving
                self._failures += 1
                log.exception("engine step failed (%d in a row)", self._failures)
                for rid in list(self._streams):
                    self._deliver(rid, exc)
                    self.engine.abort(rid)
                continue
            self._failures = 0
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
            if command.future is None or command.loop is None:
                log.exception("posted engine call failed")
            else:
                command.loop.call_soon_threadsafe(_settle, command.future, None, exc)
        else:
            if command.future is not None and command.loop is not None:
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

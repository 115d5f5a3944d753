"""One sample's way to the client: the workers' token updates in, the router's
responses out — token deltas with their text (detokenized as tokens arrive, stop
strings applied), then, once, the sample's end with its usage."""

from __future__ import annotations

import time

from kervan.tokenizer import Tokenizer
from services.common.convert import finish_from_proto
from services.proto import common_pb2, router_pb2, worker_pb2
from services.router import metrics
from services.router.detokenizer import Detokenizer
from services.router.stop_strings import StopWatch


class SampleStream:
    def __init__(self, request_id: str, sample_index: int, tokenizer: Tokenizer | None, stop: list[str],
                 num_prompt_tokens: int, start: float):
        """``start``: when the request arrived (``time.perf_counter``), for time to first token."""
        self.request_id = request_id
        self.sample_index = sample_index
        self.detok = Detokenizer(tokenizer) if tokenizer else None
        self.stop = StopWatch(stop) if stop else None
        self.num_prompt_tokens = num_prompt_tokens
        self.start = start
        self.ended = False
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def take(self, update: worker_pb2.TokenUpdate, attempt: int, cached_prompt_tokens: int
             ) -> list[router_pb2.GenerateResponse]:
        """The responses ``update`` makes; none once the sample ended (a stop string may end
        it while the worker still runs the request's other samples)."""
        if self.ended:
            return []
        out = []
        finish = update.finish_reason
        delta = None
        if update.token_ids:
            delta = self._delta(update, attempt)
        elif finish and self.detok is not None and (held := self.detok.flush()):
            # ended without a token: the bytes the detokenizer held for one that never came
            delta = self._response(delta=router_pb2.TokenDelta(
                sample_index=self.sample_index, index=self.completion_tokens, text=held, attempt=attempt))
        if delta is not None:
            if self.stop is not None:
                delta.delta.text, hit = self.stop.feed(delta.delta.text, bool(finish))
                if hit:
                    finish = common_pb2.FINISH_REASON_STOP
            out.append(delta)
        if finish:
            if self.stop is not None and self.stop.held:  # ended without new tokens: what was held back
                out.append(self._response(delta=router_pb2.TokenDelta(
                    sample_index=self.sample_index, index=self.completion_tokens, text=self.stop.feed("", True)[0],
                    attempt=attempt)))
            out.append(self._finished(finish, cached_prompt_tokens))
            self.ended = True
        return out

    def _delta(self, update: worker_pb2.TokenUpdate, attempt: int) -> router_pb2.GenerateResponse:
        now = time.perf_counter()
        if self.last_token_at is not None:
            gap = (now - self.last_token_at) / len(update.token_ids)
            for _ in update.token_ids:
                metrics.INTER_TOKEN_LATENCY.observe(gap)
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.completion_tokens += len(update.token_ids)
        metrics.GENERATION_TOKENS.inc(len(update.token_ids))
        text = self.detok.add(list(update.token_ids), final=bool(update.finish_reason)) if self.detok else ""
        return self._response(delta=router_pb2.TokenDelta(
            sample_index=self.sample_index, index=update.index, token_ids=update.token_ids, text=text,
            logprobs=update.logprobs, attempt=attempt))

    def _finished(self, finish_reason: common_pb2.FinishReason, cached_prompt_tokens: int
                  ) -> router_pb2.GenerateResponse:
        first, last = self.first_token_at, self.last_token_at
        ttft = (first - self.start) if first else 0.0
        tpot = 0.0
        if self.completion_tokens > 1 and first is not None and last is not None:
            tpot = (last - first) / (self.completion_tokens - 1)
        usage = common_pb2.Usage(prompt_tokens=self.num_prompt_tokens, cached_prompt_tokens=cached_prompt_tokens,
                                 completion_tokens=self.completion_tokens, time_to_first_token_s=ttft,
                                 time_per_output_token_s=tpot)
        if self.first_token_at:
            metrics.TIME_TO_FIRST_TOKEN.observe(ttft)
        if self.completion_tokens > 1:
            metrics.TIME_PER_OUTPUT_TOKEN.observe(tpot)
        metrics.E2E_LATENCY.observe(time.perf_counter() - self.start)
        metrics.REQUEST_GENERATION_TOKENS.observe(self.completion_tokens)
        metrics.REQUEST_SUCCESS.labels(finish_from_proto(finish_reason) or "unspecified").inc()
        return self._response(finished=router_pb2.Finished(sample_index=self.sample_index,
                                                            finish_reason=finish_reason, usage=usage))

    def _response(self, **kind) -> router_pb2.GenerateResponse:
        return router_pb2.GenerateResponse(request_id=self.request_id, **kind)

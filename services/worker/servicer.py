"""WorkerService: protobuf in, engine call, protobuf out."""

from __future__ import annotations

import grpc

from services.common.convert import finish_to_proto, sampling_from_proto
from services.proto import worker_pb2, worker_pb2_grpc
from services.worker.async_engine import AsyncEngine


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def Execute(self, request: worker_pb2.ExecuteRequest, context: grpc.aio.ServicerContext):
        params = sampling_from_proto(request.sampling)
        done: set[int] = set()  # samples whose end was already sent
        first = True
        async for out in self.engine.generate(request.request_id, list(request.prompt.ids), params):
            for c in out.outputs:
                if c.index in done or not (c.new_token_ids or c.finish_reason):
                    continue
                new = len(c.new_token_ids)
                yield worker_pb2.ExecuteResponse(
                    sample_index=c.index, index=len(c.token_ids) - new, token_ids=c.new_token_ids,
                    logprobs=c.logprobs[len(c.logprobs) - new:] if c.logprobs else [],
                    finish_reason=finish_to_proto(c.finish_reason),
                    cached_prompt_tokens=out.num_cached_tokens if first else 0)
                first = False
                if c.finish_reason:
                    done.add(c.index)

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(aborted=self.engine.abort(request.request_id))

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> worker_pb2.GetLoadResponse:
        load = self.engine.load()
        return worker_pb2.GetLoadResponse(num_running=load.num_running, num_waiting=load.num_waiting,
                                          num_free_blocks=load.num_free_blocks, num_blocks=load.num_blocks)

"""Kervan's worker engine: paged-KV, continuous-batching inference for Llama-family
and mixture-of-experts models. No gRPC in here; ``services`` wraps it."""

from worker.engine.engine import Engine
from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.engine.sampling_params import InvalidRequest, SamplingParams

__all__ = ["CompletionOutput", "Engine", "InvalidRequest", "RequestOutput", "SamplingParams"]

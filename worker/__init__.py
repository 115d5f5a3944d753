"""Kervan's engine: paged-KV, continuous-batching inference for Llama-family and
mixture-of-experts models, on torch. No gRPC in here; ``services`` wraps it. The
vocabulary it shares with the rest of the mesh (sampling parameters, request limits,
block hashes, KV events) is the torch-free ``kervan`` package; its request-facing
names are exported here too, for the offline API."""

from kervan.sampling import InvalidRequest, RequestLimits, SamplingParams
from worker.engine.engine import Engine, ImportedKV
from worker.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from worker.sequence import FetchedKV

__all__ = ["CompletionOutput", "Engine", "EngineStats", "FetchedKV", "ImportedKV", "InvalidRequest", "RequestLimits",
           "RequestOutput", "SamplingParams"]

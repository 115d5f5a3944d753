"""The only module that turns protobuf messages into domain objects and back.

Unset optional fields take the defaults documented in ``protos/kervan/v1/common.proto``;
everything else is validated by the domain constructors, whose errors name the field."""

from __future__ import annotations

from services.proto import common_pb2
from worker.engine.sampling_params import SamplingParams

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 16,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        n=msg.n if msg.HasField("n") else 1,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, n=params.n, stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        logprobs=params.logprobs)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def finish_to_proto(reason: str | None) -> int:
    return _FINISH.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_from_proto(value: int) -> str | None:
    return _FINISH_NAMES.get(value)

"""The one module that converts protobuf and domain objects: round trips, and the unset
or unknown values a client may send refused with the field named."""

import pytest

from kervan.sampling import InvalidRequest, RequestLimits, SamplingParams
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.convert import (
    role_from_proto,
    role_to_proto,
    sampling_from_proto,
    sampling_to_proto,
    worker_info_from_proto,
    worker_info_to_proto,
)
from services.proto import common_pb2, kv_registry_pb2


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(max_tokens=7, temperature=0.0, top_k=5, top_p=0.5, min_p=0.25, seed=0, n=3,
                   stop_token_ids=(2, 9), ignore_eos=True, logprobs=True),
    SamplingParams(temperature=0.75, seed=None)  # floats the wire holds exactly (float32),
])
def test_sampling_parameters_survive_the_wire_and_a_seed_of_zero_stays_a_seed(params):
    msg = sampling_to_proto(params)
    assert sampling_from_proto(msg) == params
    assert msg.HasField("seed") == (params.seed is not None)


def test_an_unset_field_means_the_engines_default():
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0  # set: greedy


def test_worker_info_round_trips_and_its_role_and_limits_are_required():
    info = WorkerInfo(worker_id="prefill@127.0.0.1:5", address="127.0.0.1:5", role=WorkerRole.PREFILL, model="m",
                      block_size=16, hash_name="sha256", limits=RequestLimits(max_model_len=640, max_n=4),
                      kv_capacity_blocks=12, registration_nonce="n", incarnation="7")
    msg = worker_info_to_proto(info)
    assert msg.role == kv_registry_pb2.WORKER_ROLE_PREFILL and msg.limits.max_model_len == 640
    assert worker_info_from_proto(msg) == info
    assert [role_from_proto(role_to_proto(r)) for r in WorkerRole] == list(WorkerRole)
    for role in (kv_registry_pb2.WORKER_ROLE_UNSPECIFIED, 9):
        with pytest.raises(InvalidRequest, match=f"role must be WORKER_ROLE_BOTH, .* got {role}"):
            role_from_proto(role)
    msg.ClearField("limits")
    with pytest.raises(InvalidRequest, match="limits.max_model_len and limits.max_n are required"):
        worker_info_from_proto(msg)


def test_a_role_is_its_name_in_ids_and_says_what_it_serves():
    assert WorkerInfo.id_of(WorkerRole.DECODE, "h:1") == "decode@h:1" and f"{WorkerRole.BOTH}" == "both"
    assert [(r.can_prefill, r.can_decode) for r in WorkerRole] == [(True, True), (True, False), (False, True)]

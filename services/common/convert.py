"""The only module that turns protobuf messages into domain objects and back
(sampling parameters, finish reasons, worker load and records, KV events).

Unset optional fields take ``SamplingParams``' defaults (as ``protos/kervan/v1/common.proto`` documents);
everything else is validated by the domain constructors, whose errors name the field."""

from __future__ import annotations

from kervan.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kervan.sampling import InvalidRequest, RequestLimits, SamplingParams
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.load import SCALARS, Load
from services.proto import common_pb2, kv_registry_pb2

# the one table of finish reasons: the engine's names (OpenAI's too) and the wire's enum
FINISH_REASONS = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
                  "abort": common_pb2.FINISH_REASON_ABORT}
_FINISH_NAMES: dict[int, str] = {int(v): k for k, v in FINISH_REASONS.items()}


_DEFAULTS = SamplingParams()  # what an unset optional field means: the engine's own defaults


def max_tokens_of(msg: common_pb2.SamplingParams) -> int:
    return msg.max_tokens if msg.HasField("max_tokens") else _DEFAULTS.max_tokens


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens_of(msg),
        temperature=msg.temperature if msg.HasField("temperature") else _DEFAULTS.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.HasField("top_p") else _DEFAULTS.top_p,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        n=msg.n if msg.HasField("n") else _DEFAULTS.n,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Every field set (a worker reads the same values, not its own defaults); no stop
    strings, which the router matches itself."""
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        min_p=params.min_p, n=params.n, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        logprobs=params.logprobs)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def finish_to_proto(reason: str | None) -> common_pb2.FinishReason:
    return FINISH_REASONS.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_from_proto(reason: int) -> str | None:
    """The name of a wire finish reason (None: unspecified)."""
    return _FINISH_NAMES.get(reason)


def load_to_proto(load: Load) -> common_pb2.WorkerLoad:
    return common_pb2.WorkerLoad(**vars(load))  # flat: vars, not asdict's deep copy (ListWorkers does 1,000)


def load_from_proto(msg: common_pb2.WorkerLoad) -> Load:
    return Load(**{name: getattr(msg, name) for name in SCALARS},
                expert_tokens_per_rank=tuple(msg.expert_tokens_per_rank))


_ROLES: dict[WorkerRole, kv_registry_pb2.WorkerRole] = {
    WorkerRole.BOTH: kv_registry_pb2.WORKER_ROLE_BOTH, WorkerRole.PREFILL: kv_registry_pb2.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: kv_registry_pb2.WORKER_ROLE_DECODE}
_ROLE_NAMES: dict[int, WorkerRole] = {v: k for k, v in _ROLES.items()}


def role_to_proto(role: WorkerRole) -> kv_registry_pb2.WorkerRole:
    return _ROLES[role]


def role_from_proto(role: int) -> WorkerRole:
    if role not in _ROLE_NAMES:
        raise InvalidRequest(f"role must be WORKER_ROLE_BOTH, WORKER_ROLE_PREFILL or WORKER_ROLE_DECODE, got {role}")
    return _ROLE_NAMES[role]


def worker_info_to_proto(info: WorkerInfo) -> kv_registry_pb2.WorkerInfo:
    return kv_registry_pb2.WorkerInfo(
        worker_id=info.worker_id, address=info.address, role=role_to_proto(info.role), model=info.model,
        incarnation=info.incarnation, block_size=info.block_size, hash_name=info.hash_name,
        limits=kv_registry_pb2.RequestLimits(max_model_len=info.limits.max_model_len, max_n=info.limits.max_n),
        kv_capacity_blocks=info.kv_capacity_blocks, registration_nonce=info.registration_nonce)


def worker_info_from_proto(msg: kv_registry_pb2.WorkerInfo) -> WorkerInfo:
    """Raises InvalidRequest for a role that is not set or not known, and for missing limits."""
    if not (msg.limits.max_model_len and msg.limits.max_n):
        raise InvalidRequest("limits.max_model_len and limits.max_n are required")
    return WorkerInfo(worker_id=msg.worker_id, address=msg.address, role=role_from_proto(msg.role), model=msg.model,
                      block_size=msg.block_size, hash_name=msg.hash_name,
                      limits=RequestLimits(max_model_len=msg.limits.max_model_len, max_n=msg.limits.max_n),
                      kv_capacity_blocks=msg.kv_capacity_blocks, registration_nonce=msg.registration_nonce,
                      incarnation=msg.incarnation)


_TIERS: dict[str, kv_registry_pb2.KvTier] = {
    "device": kv_registry_pb2.KV_TIER_DEVICE, "host": kv_registry_pb2.KV_TIER_HOST,
    "disk": kv_registry_pb2.KV_TIER_DISK}
_TIER_NAMES: dict[int, str] = {v: k for k, v in _TIERS.items()}


def tier_to_proto(medium: str) -> kv_registry_pb2.KvTier:
    return _TIERS[medium]


def tier_from_proto(tier: int) -> str:
    if tier not in _TIER_NAMES:
        raise InvalidRequest(f"tier must be KV_TIER_DEVICE, KV_TIER_HOST or KV_TIER_DISK, got {tier}")
    return _TIER_NAMES[tier]


def event_to_proto(event: KVEvent) -> kv_registry_pb2.KvEvent:
    if isinstance(event, BlockStored):
        return kv_registry_pb2.KvEvent(seq=event.seq, stored=kv_registry_pb2.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash or b"",
            tier=tier_to_proto(event.medium)))
    if isinstance(event, BlockRemoved):
        return kv_registry_pb2.KvEvent(seq=event.seq, removed=kv_registry_pb2.BlockRemoved(
            block_hashes=event.block_hashes, tier=tier_to_proto(event.medium)))
    return kv_registry_pb2.KvEvent(seq=event.seq, cleared=kv_registry_pb2.AllBlocksCleared())


def event_from_proto(msg: kv_registry_pb2.KvEvent) -> KVEvent:
    kind = msg.WhichOneof("kind")
    if kind == "stored":
        return BlockStored(msg.seq, list(msg.stored.block_hashes), msg.stored.parent_block_hash or None, [], 0,
                           tier_from_proto(msg.stored.tier))
    if kind == "removed":
        return BlockRemoved(msg.seq, list(msg.removed.block_hashes), tier_from_proto(msg.removed.tier))
    if kind == "cleared":
        return AllBlocksCleared(msg.seq)
    raise InvalidRequest(f"KV event {msg.seq} has no kind")

"""``python -m services.scheduler``: placement over gRPC, fed by the kv-registry."""

from __future__ import annotations

import argparse
import dataclasses

from services.common import replicas
from services.common.config import parse_service_args, service_parser
from services.common.metrics import serve_metrics
from services.common.security import MeshSecurity
from services.common.server import KEEPALIVE, Service, run_service, serve_until_signal, start_server
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.placement import NEW_PREFIX, PlacementConfig
from services.scheduler.policies import POLICIES
from services.scheduler.recent import RecentPlacements
from services.scheduler.servicer import SchedulerServicer

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
REGISTRY_SERVICE = kv_registry_pb2.DESCRIPTOR.services_by_name["KvRegistryService"].full_name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = service_parser("services.scheduler", __doc__)
    ap.add_argument("--registry", required=True, help="HOST:PORT of the kv-registry")
    ap.add_argument("--policy", choices=sorted(POLICIES), default=PlacementConfig.policy,
                    help="how a worker is chosen (one file each in services/scheduler/policies/): kv, KV overlap and "
                         "load, is Kervan's; the others are the baselines it is measured against")
    ap.add_argument("--hash-prefix-blocks", type=int, default=PlacementConfig.hash_prefix_blocks,
                    help="prefix_hash: the leading prompt blocks hashed")
    ap.add_argument("--cache-threshold", type=float, default=PlacementConfig.cache_threshold,
                    help="approx_tree: the share of the prompt a worker's tree must match to win on it")
    ap.add_argument("--balance-abs-threshold", type=int, default=PlacementConfig.balance_abs_threshold,
                    help="approx_tree: requests of imbalance above which the idlest worker wins ...")
    ap.add_argument("--balance-rel-threshold", type=float, default=PlacementConfig.balance_rel_threshold,
                    help="approx_tree: ... if the busiest also runs this many times the idlest's requests")
    ap.add_argument("--new-prefix", choices=NEW_PREFIX, default=PlacementConfig.new_prefix,
                    help="kv: a prompt no worker caches goes by the cost (cost) or to the worker holding the least "
                         "KV content, recent placements included (content; with --overlap-weight 6 it matched "
                         "SGLang's cache-aware router on skewed shared prefixes, benchmarks/README.md)")
    ap.add_argument("--overlap-weight", type=float, default=PlacementConfig.overlap_weight,
                    help="weight of uncached prompt blocks")
    ap.add_argument("--host-block-cost", type=float, default=PlacementConfig.host_block_cost,
                    help="a matched block in a worker's host tier, as a share of an uncached block's cost (a copy "
                         "back instead of a prefill)")
    ap.add_argument("--disk-block-cost", type=float, default=PlacementConfig.disk_block_cost,
                    help="a matched block only on a worker's disk tier, as a share of an uncached block's cost")
    ap.add_argument("--pull-block-cost", type=float, default=PlacementConfig.pull_block_cost,
                    help="pull a prefix another worker holds (it prefills, the KV moves) when the blocks saved "
                         "outweigh this share of an uncached block per prompt block moved (0: never)")
    ap.add_argument("--no-kv-fetch", dest="kv_fetch", action="store_false",
                    help="never have a worker fetch a prefix another worker holds (the cluster KV tier)")
    ap.add_argument("--link-bytes-per-s", type=float, default=PlacementConfig.link_bytes_per_s,
                    help="the link rate to price a fetch with until the workers have measured theirs (0: unknown)")
    ap.add_argument("--link-latency-s", type=float, default=PlacementConfig.link_latency_s,
                    help="a fetch's fixed cost: the link's round trip and the holder's read")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=PlacementConfig.prefill_tokens_per_s,
                    help="the prefill rate to price recomputing with until a worker has measured its own (0: unknown)")
    ap.add_argument("--eviction-weight", type=float, default=PlacementConfig.eviction_weight,
                    help="weight of cached blocks a request would evict")
    ap.add_argument("--temperature", type=float, default=PlacementConfig.temperature,
                    help="0: the lowest cost wins; > 0: a softmax draw over -cost / temperature")
    ap.add_argument("--min-remote-prefill-blocks", type=int, default=PlacementConfig.min_remote_prefill_blocks,
                    help="uncached prompt blocks below which the decode worker prefills locally")
    ap.add_argument("--max-prefill-queue-tokens", type=int, default=PlacementConfig.max_prefill_queue_tokens,
                    help="prefill-pool queue (tokens) above which the decode worker prefills locally; 0: never")
    ap.add_argument("--load-window-s", type=float, default=0.1,
                    help="how long a placement counts against a worker's load before its reports can show it")
    ap.add_argument("--prefix-window-s", type=float, default=3.0,
                    help="how long a placed prompt's blocks count as the worker's before its KV events can show them")
    ap.add_argument("--no-shortlist", dest="shortlist", action="store_false",
                    help="price every worker on each placement, not only the shortlist's (the same choice, slower at "
                         "fleet scale; for comparison)")
    ap.add_argument("--no-watch", dest="watch", action="store_false",
                    help="list the live workers (ListWorkers) instead of keeping them from the registry's "
                         "WatchWorkers stream of changes (which is listed instead while it is down)")
    ap.add_argument("--workers-cache-s", type=float, default=0.05,
                    help="when listing: placements within this long of a listing of live workers reuse it; later "
                         "ones start a new listing and, within twice a listing's time more, take the old one "
                         "meanwhile (0: every placement lists afresh; concurrent ones share one in flight)")
    ap.add_argument("--max-ejection-share", type=float, default=0.5,
                    help="at most this share of the candidate workers is avoided as suspect (found unreachable "
                         "lately by a router)")
    ap.add_argument("--panic-threshold", type=float, default=0.5,
                    help="when avoiding suspects would leave fewer than this share of the candidates, avoid none")
    ap.add_argument("--seed", type=int, default=None, help="seed of the random draws (random policy, temperature)")
    return parse_service_args(ap, "scheduler", argv)


def placement_config(args: argparse.Namespace) -> PlacementConfig:
    """The policy's flags; each field of PlacementConfig has one."""
    return PlacementConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PlacementConfig)})


async def serve(args: argparse.Namespace) -> None:
    security = MeshSecurity.from_args(args)
    channel = security.channel(replicas.target(args.registry), KEEPALIVE + replicas.options(REGISTRY_SERVICE),
                               role="kv-registry")
    servicer = SchedulerServicer(kv_registry_pb2_grpc.KvRegistryServiceStub(channel), placement_config(args),
                                 recent=RecentPlacements(args.load_window_s, args.prefix_window_s), seed=args.seed,
                                 max_ejection_share=args.max_ejection_share, panic_threshold=args.panic_threshold,
                                 workers_cache_s=args.workers_cache_s, shortlist=args.shortlist, watch=args.watch)
    handle = await start_server([Service(SERVICE_NAME, lambda s: (
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s)), {"*": ("router", "admin")})],
        args.host, args.port, security=security)
    serve_metrics(args.metrics_port, args.host, "scheduler")
    print(f"scheduler ready on {args.host}:{handle.port}", flush=True)
    async def stop() -> None:
        if servicer.watch is not None:
            servicer.watch.close()
        await channel.close()
    await serve_until_signal(handle, stop)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_service("kervan-scheduler", lambda: serve(args))


if __name__ == "__main__":
    main()

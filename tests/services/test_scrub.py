"""What a client may read of a failure inside the mesh: no address, URL or worker id, in
any of the forms the router, the workers and gRPC itself write them; a client's own
mistake still reads as it was written."""

from __future__ import annotations

import grpc
import pytest

from services.router.scrub import public_message

LEAKS = [
    "worker ipv4:10.1.2.3:50060 lost: Socket closed",  # gRPC's peer names
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv6:%5B::1%5D:50060: Connection refused",
    "ipv6:[fe80::1]:50060 reset",
    "unix:/run/kervan/worker.sock closed",
    "connect to [2001:db8::7]:443 timed out",
    "peer at %5B2001:db8::1%5D:80",
    "peer fe80::1ff:fe23:4567:890a down",
    "a 2001:db8:0:0:1:2:3:4 b",
    "x ::1 y",
    "Redis at redis://:hunter2@redis-0:6379/0 refused",
    "worker decode@10.0.0.5:50051 is at its request limit",  # a worker id
    "worker decode@[::1]:5000 is draining",
    "decode-0.kervan.svc:50051 refused the stream",
    "10.2.3.4 unreachable",
    "peer fe80::1%eth0 down",  # an IPv6 zone names the host's interface
    "10-0-0-5.kervan.pod.cluster.local refused",  # a pod's DNS name
    "decode-0.decode.kervan.svc answered late",
    "worker on ip-10-0-0-5.ec2.internal lost",
]


@pytest.mark.parametrize("message", LEAKS)
def test_the_mesh_s_addresses_never_reach_the_client(message):
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL):
        public = public_message(code, message)
        assert "<internal>" in public
        for secret in ("10.", "::1", "fe80", "2001", "hunter2", "redis-0", "kervan.svc", "5000", "50051", "50060",
                       "/run/", "eth0", "10-0-0-5", "cluster.local", ".internal", "decode-0"):
            assert secret not in public, (message, public)


@pytest.mark.parametrize("message", [
    "prompt.token_ids [200] are outside the vocabulary [0, 128)",
    "max_tokens 5000 is more than 4096 at 12:30:45",
    "request_id 'dup-1' is already in flight",
    "stop strings: ['::']",
])
def test_a_client_mistake_reads_as_written(message):
    assert public_message(grpc.StatusCode.INVALID_ARGUMENT, message) == message

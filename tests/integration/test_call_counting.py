"""Every channel made by ``make_channel`` counts its calls, checked against a real loopback
gRPC server (the health service every role serves)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlfleet.common import call_counts
from rlfleet.common.grpc_client import make_channel
from rlfleet.common.grpc_server import GrpcServer


async def test_channels_count_their_calls():
    server = GrpcServer([], "127.0.0.1", 0)
    port = await server.start()
    try:
        channel = make_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)
        before = call_counts.snapshot()
        for _ in range(3):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        first = await watch.read()  # a server-streaming call counts as one call too
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        after = call_counts.snapshot()
        await channel.close()
    finally:
        await server.stop(0)
    metrics = call_counts.per_step_metrics(before, after)
    assert metrics["perf/grpc_calls/Check"] == 3.0
    assert metrics["perf/grpc_calls/Watch"] == 1.0
    assert metrics["perf/grpc_calls"] == 4.0

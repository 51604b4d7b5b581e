"""The trainer's control service over real gRPC (loopback): status, pause/resume, stop,
metrics streaming, auth and error mapping."""

from __future__ import annotations

import grpc
import pytest

from rlfleet.common.config import load_config
from rlfleet.common.grpc_client import auth_metadata, make_channel
from rlfleet.proto import common_pb2, trainer_pb2, trainer_pb2_grpc
from rlfleet.trainer.metrics import MetricsWriter
from rlfleet.trainer.server import control_server
from rlfleet.trainer.trainer import Trainer


@pytest.fixture
async def control(tmp_path):
    config = load_config(None, ["trainer.port=0", "api_key=secret", f"run_dir={tmp_path}"], env={})
    trainer = Trainer(config, fleet=None, actor=None, tokenizer=None)
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    server = control_server(config)(trainer, writer)
    port = await server.start()
    channel = make_channel(f"127.0.0.1:{port}", retry=False)
    try:
        yield trainer, writer, trainer_pb2_grpc.TrainerStub(channel)
    finally:
        await channel.close()
        await server.stop(0.5)


AUTH = auth_metadata("secret")


async def test_status_pause_resume_stop(control):
    trainer, _, stub = control
    trainer.state, trainer.step, trainer.version = "running", 4, 5
    status = await stub.GetStatus(common_pb2.Empty(), metadata=AUTH)
    assert (status.state, status.step, status.weight_version) == ("running", 4, 5)
    assert (await stub.Pause(common_pb2.Empty(), metadata=AUTH)).state == "paused"
    assert not trainer._resume.is_set()
    assert (await stub.Resume(common_pb2.Empty(), metadata=AUTH)).state == "running"
    await stub.Stop(common_pb2.Empty(), metadata=AUTH)
    assert trainer.stop_requested


async def test_stream_metrics_sends_history_then_ends_when_done(control):
    trainer, writer, stub = control
    writer.write(1, {"critic/score/mean": 0.25})
    writer.write(2, {"critic/score/mean": 0.5})
    trainer.state = "done"
    request = trainer_pb2.StreamMetricsRequest(from_step=2)
    records = [r async for r in stub.StreamMetrics(request, metadata=AUTH)]
    assert [(r.step, r.metrics["critic/score/mean"]) for r in records] == [(2, 0.5)]


async def test_missing_api_key_is_unauthenticated(control):
    _, _, stub = control
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetStatus(common_pb2.Empty())
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

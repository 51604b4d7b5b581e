"""The trainer's control surface (service ``rlfleet.v1.Trainer``): proto <-> Trainer calls."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlfleet.common.grpc_server import GrpcServer, Registration
from rlfleet.proto import trainer_pb2, trainer_pb2_grpc
from rlfleet.trainer.state import TrainerState


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, trainer, writer) -> None:
        self._trainer = trainer
        self._writer = writer

    def _status(self) -> trainer_pb2.TrainerStatus:
        t = self._trainer
        return trainer_pb2.TrainerStatus(
            state=t.state,
            step=t.step,
            total_steps=t.config.trainer.total_steps,
            weight_version=t.version,
            run_dir=t.config.run_dir,
        )

    async def GetStatus(self, request, context):
        return self._status()

    async def Pause(self, request, context):
        self._trainer.pause()
        return self._status()

    async def Resume(self, request, context):
        self._trainer.resume()
        return self._status()

    async def Stop(self, request, context):
        self._trainer.request_stop()
        return self._status()

    async def SaveCheckpoint(self, request, context):
        from rlfleet.trainer.run import save_checkpoint

        t = self._trainer
        path = Path(request.path or Path(t.config.run_dir) / "checkpoints" / f"manual_{t.step}")
        await asyncio.to_thread(save_checkpoint, t, path)
        return trainer_pb2.SaveCheckpointResponse(path=str(path), step=t.step)

    async def StreamMetrics(self, request, context):
        sent = 0
        while True:
            history = self._writer.history
            for record in history[sent:]:
                sent += 1
                if record["step"] >= request.from_step:
                    metrics = {k: v for k, v in record.items() if k != "step"}
                    yield trainer_pb2.MetricsRecord(step=record["step"], metrics=metrics)
            if self._trainer.state == TrainerState.DONE:
                return
            await asyncio.sleep(0.5)


def control_server(config):
    """Factory the run loop calls once the Trainer exists."""

    def build(trainer, writer) -> GrpcServer:
        servicer = TrainerServicer(trainer, writer)
        registration = Registration(
            trainer_pb2_grpc.add_TrainerServicer_to_server, servicer, "rlfleet.v1.Trainer"
        )
        t = config.trainer
        return GrpcServer([registration], t.host, t.port, config.max_message_mb, config.api_key)

    return build

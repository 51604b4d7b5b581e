"""The Tinker API's core: sessions, training clients, sampling sessions and their futures.

No HTTP here: ``app`` turns requests into these calls and answers into bodies. A training call
is checked at the door (``checks``; a refusal is an HTTP 400 that names what is wrong), gets a
request id at once (``futures``; a repeat of the same ``(model_id, seq_id)`` gets the same id
and runs once), waits for its client's earlier calls (``gate``), and runs on the single compute
thread (torch is blocking; one call at a time also makes switching adapters safe).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rlfleet.common.config.tinker import TinkerConfig
from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound
from rlfleet.trainer.tinker import checkpoints, checks
from rlfleet.trainer.tinker.adapters import AdapterPool
from rlfleet.trainer.tinker.futures import Futures
from rlfleet.trainer.tinker.gate import SeqGate
from rlfleet.trainer.tinker.sampler import Sampler, Snapshot
from rlfleet.trainer.tinker.types import (
    AdamStep,
    Datum,
    LoraSpec,
    ModelInfo,
    SampledSequence,
    SampleSpec,
    Saved,
    ServedModel,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
BASE = "base"
"""The snapshot key of the base model (no adapter)."""


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    adapter: str
    spec: LoraSpec
    gate: SeqGate = field(default_factory=SeqGate)


@dataclass
class Session:
    session_id: str
    finished: bool = False
    samplers: int = 0


class TinkerService:
    """Everything the HTTP routes call (see the module docstring)."""

    def __init__(
        self,
        cfg: TinkerConfig,
        served: ServedModel,
        pool: AdapterPool,
        sampler: Sampler,
        root: Path,
    ) -> None:
        self.cfg, self.served, self.pool, self.sampler, self.root = cfg, served, pool, sampler, root
        self.futures = Futures(cfg.kept_results, cfg.future_wait_s)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.snapshots: dict[str, tuple[Snapshot, str]] = {}
        """Sampling session id -> (its weights, its owner session)."""
        self._ids = itertools.count(1)
        self._run = uuid.uuid4().hex[:8]
        """In every session id, so a restarted server's ids (and the checkpoint folders named
        after its training clients) never repeat an earlier run's."""
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="tinker-compute")

    # ---- sessions ---------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = f"session-{self._run}-{next(self._ids)}"
        self.sessions[session_id] = Session(session_id)
        return session_id

    def session(self, session_id: str) -> Session:
        if session_id not in self.sessions:
            raise NotFound(f"no session {session_id!r}")
        return self.sessions[session_id]

    def finish_session(self, session_id: str) -> None:
        """The session ends: its training clients are dropped (their adapters freed)."""
        self.session(session_id).finished = True
        for model in [m for m in self.models.values() if m.session_id == session_id]:
            del self.models[model.model_id]
            self._run_later(self.pool.delete, model.adapter)

    def live_session(self, session_id: str) -> Session:
        session = self.session(session_id)
        if session.finished:
            raise FailedPrecondition(f"session {session_id} has finished")
        return session

    # ---- training clients -------------------------------------------------------------

    def create_model(self, session_id: str, seq: int, base_model: str, spec: LoraSpec) -> str:
        """A new LoRA training client (request id; the future answers its model id)."""
        self.live_session(session_id)
        model_id = f"{session_id}:train:{seq}"
        key = f"create:{model_id}"
        if self.futures.request_for(key) is None:
            self._check_base(base_model)
            checks.lora_spec(spec, self.served.max_rank)
            if len(self.models) >= self.cfg.max_adapters:
                raise FailedPrecondition(
                    f"this server holds at most {self.cfg.max_adapters} "
                    "training clients at once (tinker.max_adapters)"
                )
            self.models[model_id] = TrainingModel(model_id, session_id, f"m{next(self._ids)}", spec)
        model = self.models[model_id]

        async def work() -> str:
            await self._on_compute(self.pool.create, model.adapter, spec)
            return model_id

        return self.futures.submit(key, work)[0]

    def model(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise NotFound(f"no training client {model_id!r} (unknown, or its session finished)")
        self.live_session(model.session_id)
        return model

    def info(self, model_id: str) -> ModelInfo:
        model, served = self.model(model_id), self.served
        return ModelInfo(model_id, served.name, served.tokenizer_id, model.spec.rank, served.arch)

    def forward_backward(
        self,
        model_id: str,
        seq_id: int | None,
        data: Sequence[Datum],
        loss_fn: str,
        config: Mapping[str, float],
        forward_only: bool,
    ) -> str:
        model = self.model(model_id)
        if repeat := self._repeat(model, seq_id):
            return repeat
        loss = self._refuse_gap(model, seq_id, lambda: checks.loss_named(loss_fn))
        self._refuse_gap(
            model,
            seq_id,
            lambda: checks.datums(data, loss_fn, loss, self.served.max_context, self.served.vocab),
        )
        settings = self._refuse_gap(
            model, seq_id, lambda: checks.loss_config(loss_fn, loss, config)
        )
        micro = self.cfg.micro_batch_tokens
        return self._ordered(
            model,
            seq_id,
            self.pool.forward,
            model.adapter,
            data,
            loss,
            settings,
            not forward_only,
            micro,
        )

    def optim_step(self, model_id: str, seq_id: int | None, step: AdamStep) -> str:
        model = self.model(model_id)
        if repeat := self._repeat(model, seq_id):
            return repeat
        self._refuse_gap(model, seq_id, lambda: checks.adam(step))
        return self._ordered(model, seq_id, self.pool.step, model.adapter, step)

    def save_state(
        self, model_id: str, seq_id: int | None, name: str, overwrite: bool, ttl_seconds: int | None
    ) -> str:
        model = self.model(model_id)
        if repeat := self._repeat(model, seq_id):
            return repeat
        path = self._refuse_gap(
            model,
            seq_id,
            lambda: checkpoints.CheckpointPath(
                model_id, "weights", checkpoints.checkpoint_name(name)
            ),
        )
        folder = path.folder(self.root)
        if folder.exists() and not overwrite:
            self._refuse_gap(
                model,
                seq_id,
                lambda: _raise(
                    InvalidArgument(
                        f"checkpoint {path.uri} exists (pass overwrite=True to replace it)"
                    )
                ),
            )
        meta = self._meta(model, ttl_seconds)
        return self._ordered(model, seq_id, self._save, model.adapter, folder, meta, path.uri)

    def load_state(self, model_id: str, seq_id: int | None, uri: str, optimizer: bool) -> str:
        model = self.model(model_id)
        if repeat := self._repeat(model, seq_id):
            return repeat
        _, folder = self._refuse_gap(model, seq_id, lambda: checkpoints.existing(uri, self.root))
        return self._ordered(
            model, seq_id, self._load, model.adapter, folder, optimizer, uri, model_id
        )

    def save_for_sampler(
        self, model_id: str, seq_id: int | None, name: str | None, ttl_seconds: int | None
    ) -> str:
        """With ``name``: a sampler checkpoint on disk (its ``tinker://`` path); without: a new
        sampling session on a snapshot of the adapter as it is now."""
        model = self.model(model_id)
        if repeat := self._repeat(model, seq_id):
            return repeat
        if name is None:
            return self._ordered(model, seq_id, self._snapshot, model)
        path = self._refuse_gap(
            model,
            seq_id,
            lambda: checkpoints.CheckpointPath(
                model_id, "sampler_weights", checkpoints.checkpoint_name(name)
            ),
        )
        meta = self._meta(model, ttl_seconds)
        return self._ordered(
            model, seq_id, self._save, model.adapter, path.folder(self.root), meta, path.uri
        )

    # ---- sampling ---------------------------------------------------------------------

    def create_sampling_session(
        self, session_id: str, base_model: str | None, model_path: str | None
    ) -> str:
        """A sampling session on the base model, or on a sampler checkpoint (``model_path``)."""
        session = self.live_session(session_id)
        if model_path is None:
            self._check_base(base_model or "")
            snapshot = Snapshot(BASE, self.served.base_state)
        else:
            _, folder = checkpoints.existing(model_path, self.root)
            snapshot = Snapshot(model_path, self._read_wire_state(folder))
        return self._add_sampler(session, snapshot)

    def sampler_info(self, sampling_session_id: str) -> tuple[str, str | None]:
        """``(base model, model path or None)`` of a sampling session."""
        snapshot, _ = self._sampling(sampling_session_id)
        return self.served.name, snapshot.key if snapshot.key.startswith("tinker://") else None

    def sample(self, sampling_session_id: str, seq_id: int | None, spec: SampleSpec) -> str:
        snapshot, owner = self._sampling(sampling_session_id)
        self.live_session(owner)
        max_tokens = checks.sample(spec, self.served.max_context, self.served.vocab)

        async def work() -> list[SampledSequence]:
            return await self.sampler.sample(snapshot, spec, max_tokens, sampling_session_id)

        key = None if seq_id is None else f"sample:{sampling_session_id}:{seq_id}"
        return self.futures.submit(key, work)[0]

    # ---- helpers ----------------------------------------------------------------------

    def _check_base(self, base_model: str) -> None:
        if base_model != self.served.name and base_model not in self.served.aliases:
            raise InvalidArgument(
                f"base model {base_model!r} is not served here; this fleet "
                f"serves {self.served.name!r} only"
            )

    def _sampling(self, sampling_session_id: str) -> tuple[Snapshot, str]:
        if sampling_session_id not in self.snapshots:
            raise NotFound(f"no sampling session {sampling_session_id!r}")
        return self.snapshots[sampling_session_id]

    def _add_sampler(self, session: Session, snapshot: Snapshot) -> str:
        sampler_id = f"{session.session_id}:sample:{session.samplers}"
        session.samplers += 1
        self.snapshots[sampler_id] = (snapshot, session.session_id)
        return sampler_id

    def _snapshot(self, model: TrainingModel) -> Saved:
        state = self.pool.wire_state(model.adapter)  # on the compute thread (see _ordered)
        key = f"{model.model_id}@{next(self._ids)}"
        session = self.sessions[model.session_id]
        return Saved(sampling_session_id=self._add_sampler(session, Snapshot(key, state)))

    def _save(self, adapter: str, folder: Path, meta: dict, uri: str) -> Saved:
        self.pool.save(adapter, folder, meta)
        return Saved(path=uri)

    def _load(self, adapter: str, folder: Path, optimizer: bool, uri: str, model_id: str) -> Saved:
        self.pool.load(adapter, folder, optimizer)
        return Saved(path=uri, model_id=model_id)

    def _read_wire_state(self, folder: Path) -> dict:
        from rlfleet.trainer.tinker.adapters import wire_state_of

        return wire_state_of(folder)

    def _meta(self, model: TrainingModel, ttl_seconds: int | None) -> dict[str, Any]:
        spec = model.spec
        return {
            "base_model": self.served.name,
            "rank": spec.rank,
            "lora_alpha": self.pool.lora_alpha,
            "train_attn": spec.train_attn,
            "train_mlp": spec.train_mlp,
            "model_id": model.model_id,
            "ttl_seconds": ttl_seconds,
        }

    def _repeat(self, model: TrainingModel, seq_id: int | None) -> str | None:
        """The request id of an earlier copy of this call (the SDK retried it), if any."""
        return None if seq_id is None else self.futures.request_for(f"{model.model_id}:{seq_id}")

    def _refuse_gap(self, model: TrainingModel, seq_id: int | None, check: Callable[[], T]) -> T:
        """Run ``check``; if it refuses the call, the call's ``seq_id`` still passes (the
        client's later calls must not wait for it)."""
        try:
            return check()
        except Exception:
            if seq_id is not None:
                asyncio.get_running_loop().create_task(model.gate.skip(seq_id))
            raise

    def _ordered(self, model: TrainingModel, seq_id: int | None, fn: Callable, *args) -> str:
        """Submit ``fn(*args)`` to run on the compute thread in ``seq_id`` order.

        The turn passes on once the call is queued on the compute thread, not once it has run:
        that thread runs its queue in order, so the client's next call (the ``optim_step``
        behind a ``forward_backward``) is queued right behind it and starts the moment it ends,
        without a round through the event loop, which is busy with HTTP in between."""

        async def work() -> Any:
            async with model.gate.turn(seq_id):
                queued = self._compute.submit(fn, *args)
            return await asyncio.wrap_future(queued)

        key = None if seq_id is None else f"{model.model_id}:{seq_id}"
        return self.futures.submit(key, work)[0]

    async def _on_compute(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    def _run_later(self, fn: Callable, *args) -> None:
        asyncio.get_running_loop().run_in_executor(self._compute, fn, *args)

    async def close(self) -> None:
        await self.futures.close()
        await self.sampler.close()
        self._compute.shutdown(wait=False, cancel_futures=True)


def _raise(error: Exception) -> None:
    raise error

"""``rlfleet trainer`` with ``tinker.enabled``: the Tinker API instead of a training loop.

Assembles the base model, the adapter pool, the sampler (router client + weight pushes), the
core and its HTTP app; serves until SIGTERM/SIGINT. The base URL goes to
``run_dir/endpoints.json`` as ``tinker: {http: URL}``; the trainer's gRPC address answers
health checks (no ``Trainer`` service: there is no loop to control).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from pathlib import Path

from rlfleet.common import tls
from rlfleet.common.config import RlfleetConfig
from rlfleet.common.endpoints import describe, write_endpoints
from rlfleet.common.grpc_server import GrpcServer, install_stop_signals
from rlfleet.common.http_server import make_http_server
from rlfleet.model import lora
from rlfleet.trainer.tinker.adapters import ATTENTION, AdapterPool
from rlfleet.trainer.tinker.app import create_app
from rlfleet.trainer.tinker.sampler import Sampler
from rlfleet.trainer.tinker.service import TinkerService
from rlfleet.trainer.tinker.types import ServedModel

log = logging.getLogger(__name__)
NOT_TOKENIZER = ("config.json", "generation_config.json", "README.md")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")


def export_tokenizer(model_dir: Path, target: Path) -> Path:
    """The model's tokenizer files alone in ``target``: ``AutoTokenizer.from_pretrained`` (what
    the SDK's ``get_tokenizer`` calls) then loads the tokenizer those files define, offline,
    instead of the one transformers picks for the model's architecture."""
    target.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in NOT_TOKENIZER and path.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(path, target / path.name)
    return target


def zero_adapter(base) -> dict:
    """A rank-1 adapter of zeros on the first attention projection: pushed, replicas serve the
    plain base (an adapter update restores every weight it does not touch)."""
    import torch

    name, layer = next(
        (n, m)
        for n, m in base.named_modules()
        if isinstance(m, torch.nn.Linear) and ATTENTION.search(n)
    )
    out_features, in_features = layer.weight.shape
    weight = f"{name}.weight"
    return {
        lora.adapter_name(weight, "A"): torch.zeros(1, in_features),
        lora.adapter_name(weight, "B"): torch.zeros(out_features, 1),
    }


def served_model(config: RlfleetConfig, base, tokenizer, root: Path) -> ServedModel:
    from rlfleet.model.model_io import local_model_dir

    model_dir = local_model_dir(config.model.path).resolve()
    eos = {tokenizer.eos_token_id} | set(_as_list(base.generation_config.eos_token_id))
    return ServedModel(
        name=str(model_dir),
        aliases=frozenset({config.model.path, model_dir.name}),
        tokenizer_id=str(export_tokenizer(model_dir, root / "tokenizer")),
        max_context=config.rollout.max_model_len,
        max_rank=config.model.lora_rank,
        vocab=base.get_input_embeddings().num_embeddings,
        arch=(base.config.architectures or ["unknown"])[0],
        eos_ids=frozenset(i for i in eos if i is not None),
        base_state=zero_adapter(base),
    )


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def load_base(config: RlfleetConfig, root: Path) -> tuple[ServedModel, AdapterPool]:
    """The base model (blocking: run it off the event loop) and what the API says of it."""
    import torch

    from rlfleet.model.model_io import load_causal_lm, load_tokenizer

    torch.set_num_threads(config.trainer.torch_threads)
    m = config.model
    base = load_causal_lm(m.path, m.dtype, m.attn_implementation)
    served = served_model(config, base, load_tokenizer(m.path), root)
    return served, AdapterPool(base, m.lora_alpha)


async def build_service(config: RlfleetConfig) -> TinkerService:
    """The core over the fleet (the gRPC clients are made on the running loop)."""
    from rlfleet.rollout.client import RolloutClient
    from rlfleet.trainer.weight_sync import grpc_weight_sync

    root = Path(config.run_dir) / "tinker"
    served, pool = await asyncio.to_thread(load_base, config, root)
    key, mb, t = config.api_key, config.max_message_mb, config.trainer
    rollout = RolloutClient(config.endpoints.router, api_key=key, max_message_mb=mb)
    weights = grpc_weight_sync(
        config.endpoints.router,
        key,
        mb,
        t.weight_shared_memory,
        transport_kind=t.weight_transport,
        relay_fanout=t.relay_fanout,
        broadcast_timeout_s=t.weight_broadcast_timeout_s,
    )
    sampler = Sampler(
        rollout, weights, t.min_replicas, t.replica_wait_s, config.tinker.sample_timeout_s
    )
    return TinkerService(config.tinker, served, pool, sampler, root)


async def serve(config: RlfleetConfig) -> None:
    """Serve the API until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    service = await build_service(config)
    health = GrpcServer(
        [],
        config.trainer.host,
        config.trainer.port,
        config.max_message_mb,
        config.api_key,
        config.tls,
    )
    await health.start()
    cfg = config.tinker
    app = create_app(service, config.api_key, https=tls.scheme(config.tls) == "https")
    server = make_http_server(app, cfg.host, cfg.port, config.tls)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    serving.result() if serving.done() else None  # a failed bind says why
    port = int(server.servers[0].sockets[0].getsockname()[1])
    scheme = tls.scheme(config.tls)
    addresses = {"http": f"{scheme}://{cfg.host}:{port}"}
    write_endpoints(config.run_dir, "tinker", addresses)
    log.info("Tinker API: %s (base model %s)", describe("tinker", addresses), service.served.name)
    await asyncio.wait(
        [serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
    )
    server.should_exit = True
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    await service.close()
    await health.stop()

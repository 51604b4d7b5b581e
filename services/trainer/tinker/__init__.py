"""The Tinker-compatible training API, served by the trainer role (``tinker.enabled``).

A client drives its own loop with the official ``tinker`` SDK (``forward_backward``,
``optim_step``, ``save_weights_and_get_sampling_client``, ``sample``); the trainer holds one
base model with a LoRA adapter and an AdamW state per training client, and samples through the
fleet's router after pushing the sampled adapter to the replicas. Layout: ``types`` (plain
records), ``futures`` (request ids, idempotent submission), ``gate`` (per-model order),
``compute`` (forward/backward over datums), ``adapters`` (peft adapters and their optimizers),
``checkpoints`` (``tinker://`` paths on disk), ``sampler`` (weights on the replicas, batched
generation), ``service`` (the core: sessions, models, validation), ``convert`` (JSON and
protobuf bodies), ``app`` (HTTP routes), ``serve`` (assembly). See docs/tinker.md.
"""

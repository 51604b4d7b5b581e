"""Model layer: loading causal LMs and tokenizers, LoRA adapters, the optimizer, Hub names and
the weight codec. The one layer (with the roles above it) that may import torch, transformers
and safetensors; ``rlfleet.common`` below it stays free of them (``scripts/check_layers.py``)."""

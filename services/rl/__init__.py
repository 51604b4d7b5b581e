"""RL math below every role: advantages, policy/value losses, KL, and the padded-sequence
helpers that turn token lists into log-probs. Pure functions over tensors; no I/O, no gRPC."""

"""``python -m areal_grpc.tinker``: the Tinker-compatible LoRA training service."""

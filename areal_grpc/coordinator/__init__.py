"""The coordinator: entry point of a run (``python -m areal_grpc.coordinator``)."""

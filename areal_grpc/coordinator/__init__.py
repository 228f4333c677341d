"""The coordinator: entry point of a run (``python -m areal_grpc.coordinator``).

Modules: ``loop`` (the training loop), ``pool`` (queue, leases, buffer and the staleness
rule), ``dataloader`` (exact-position prompt loader), ``evaluator`` (greedy accuracy on the eval
split over the servers in rotation), ``service`` (CoordinatorService),
``launcher`` (the run's launcher by ``launcher.mode``), ``mesh`` (local launcher / attach
mode), ``ray_launcher`` (servers as Ray actors), ``metrics`` (JSONL, TensorBoard, PNG),
``checkpoint`` (recovery checkpoints), ``serve`` (``areal-coordinator``, the service alone).

This is the entry-point layer: it may import ``areal_clients`` and launch servers; the core
modules (``areal_grpc/*.py``) never import it.
"""

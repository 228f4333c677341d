"""The coordinator: entry point of a run (``python -m areal_grpc.coordinator``).

Modules: ``loop`` (the training loop, which orders the phases), and its components:
``rollout_fleet`` (rollout servers, streams, submission, supervision), ``trainer_group`` (the
ranks' clients and collective calls), ``syncer`` (weight-sync orchestration), ``recovery``
(checkpoints, resume, trainer-group recovery), ``run_log`` (result and metrics), ``pool``
(queue, leases, buffer and the staleness rule), ``dataloader`` (the run's items and the
exact-position prompt loader), ``evaluator`` (greedy accuracy on the eval split over the
servers in rotation), ``service`` (CoordinatorService), ``launcher`` (the run's launcher by
``launcher.mode``), ``mesh`` (local launcher / attach mode), ``ray_launcher`` (servers as Ray
actors), ``metrics`` (JSONL, TensorBoard, PNG), ``checkpoint`` (recovery checkpoints),
``serve`` (``areal-coordinator``, the service alone).

This is the entry-point layer: it may import ``areal_clients`` and launch servers; the core
modules (``areal_grpc/*.py``) never import it (``tests/unit/test_layering.py`` checks).
"""

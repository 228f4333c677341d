"""Trainer rank: FSDP2 GRPO / decoupled-PPO steps behind TrainerService.

Modules, bottom up:

* ``algorithm``: reward shaping, group/batch normalisation, advantages, the decoupled PPO loss
  (token-aligned tensors; pure functions and config dataclasses).
* ``microbatch``: token-budget micro-batches packed with FFD, equal count on every rank.
* ``engine``: process group, model, ``fully_shard``, AdamW + schedule, the step, checkpoints,
  Hugging Face export.
* ``service``: the grpc.aio TrainerService (torch work on one worker thread).
* ``__main__``: the ``areal-trainer`` command.
"""

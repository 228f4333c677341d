"""Multi-tenant LoRA training: one frozen base model, one named peft adapter per training run.

Modules:

* ``engine``: :class:`~areal_servers.lora_training.engine.LoraEngine`, the pure-Python compute
  core (Tinker-style forward_backward with a named loss, optim_step, sampler snapshots,
  sampling, save/load of adapter and optimizer state). No networking; one caller thread.
"""

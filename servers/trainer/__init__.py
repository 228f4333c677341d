"""Trainer rank: FSDP2 GRPO / decoupled-PPO steps behind TrainerService."""

"""Rollout server: inference engines, workflows, RolloutService and WeightSyncService."""

"""Service implementations (import name ``areal_servers``): rollout, trainer, weight sync."""

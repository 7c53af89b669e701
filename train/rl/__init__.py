"""Reinforcement learning on the run's own samples: the GRPO family on packed groups."""

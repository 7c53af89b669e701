"""Reinforcement learning with verifiable rewards (GRPO and its family) on packed groups.

  python -m train.main --config=configs/grpo.py --config.data.train=PROMPTS \\
      --config.model.init_from=MODEL_DIR                   # GRPO from a model
  python -m train.main --config=configs/grpo.py:smoke --config.data.train=PROMPTS   # seconds

PROMPTS is a directory written by `segpack tokenize --format prompts` (JSONL with a `prompt`
and the fields the rewards read, such as `answer`). Every step samples completions of its
prompts with the current weights, rewards them, packs every group whole (its prompt once) and
trains the clipped objective of `rl.loss`. See docs/rl.md.
"""

from __future__ import annotations

import ml_collections

from configs import packed


def base_config() -> ml_collections.ConfigDict:
  """The packed config with an RL loss over data.train's prompts."""
  c = packed.base_config()
  c.rl.loss = "grpo"
  c.packing.seq_len = 2048
  c.train.batch_size = 4  # rows per optimizer step (a round's groups fill one or more steps)
  c.train.num_steps = 200
  c.train.learning_rate = 1e-6  # TRL's GRPO default, for a pretrained model
  c.train.warmup_steps = 0
  c.train.weight_decay = 0.0
  # The held-out prompts (data.eval, or data.eval_share of data.train's) answered greedily and
  # rewarded; train.eval_batches * rl.prompts_per_step of them (0: all)
  c.train.eval_every = 50
  c.train.checkpoint_every = 50
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """RL on packed groups; `arg="smoke"` shrinks the run to seconds."""
  c = base_config()
  if arg == "smoke":
    c = packed.smoke(c)
    c.packing.seq_len = 256
    c.rl.num_generations = 4
    c.rl.prompts_per_step = 2
    c.rl.max_completion_length = 16
    c.train.learning_rate = 1e-3
  return packed.finish(c, None if arg == "smoke" else arg)

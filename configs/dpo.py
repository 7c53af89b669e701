"""Preference training (DPO by default) on packed pairs: each pair whole in one row.

  python -m train.main --config=configs/dpo.py --config.data.train=PAIRS \\
      --config.model.init_from=SFT_MODEL_DIR                # DPO from an SFT model
  python -m train.main --config=configs/dpo.py:smoke --config.data.train=PAIRS   # seconds

PAIRS is a directory written by `segpack tokenize --format preference` (JSONL in TRL's explicit
or implicit shape). The reference's log-probs are computed once, before the first step, with
the initial weights (`preference.reference="init"`) and kept in WORKDIR/reference. See
docs/preference.md.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from configs import packed


def base_config() -> ml_collections.ConfigDict:
  """The packed config with a preference loss over data.train's pairs."""
  c = packed.base_config()
  c.preference.loss = "dpo"
  c.preference.beta = 0.1  # DPO's usual beta (TRL's default)
  c.packing.seq_len = 1024
  c.train.batch_size = 8
  # Length, rate and warmup by recipe (train/recipe.py): with model.init_from 3 epochs at 2e-5
  # (TRL's DPO uses 1e-6 to 5e-7 for billions of parameters: set train.learning_rate for them)
  c.train.num_steps = config_dict.placeholder(int)
  c.train.learning_rate = config_dict.placeholder(float)
  c.train.warmup_steps = config_dict.placeholder(int)
  c.train.eval_every = 100
  c.train.eval_batches = 0  # every held-out pair
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """DPO on packed pairs; `arg="smoke"` shrinks the run to seconds."""
  c = base_config()
  if arg == "smoke":
    c = packed.smoke(c)
    c.packing.seq_len = 512
  return packed.finish(c, None if arg == "smoke" else arg)

"""Chat fine-tuning (SFT): the built-in chat corpus, assistant-only loss, minibatch packing.

  python -m train.main --config=configs/sft.py            # one model, a few epochs, CPU minutes
  python -m train.main --config=configs/sft.py:smoke      # seconds (small corpus, tiny model)
  python -m train.main --config=configs/sft.py --config.packing.mode=global

Every optimizer step takes the minibatch of `packing.examples_per_batch` conversations that
unpacked random sampling would draw and packs it into `train.batch_size` rows (the static row
count of every step; a minibatch that needs more rows stops the run with an error naming it). With
`packing.mode="global"` the rows of one FFD plan over the epoch are batched instead (fewer steps
per epoch). See docs/sft.md.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from configs import packed


def base_config() -> ml_collections.ConfigDict:
  """The packed config with chat data (assistant-only loss) and minibatch packing."""
  c = packed.base_config()
  c.data.source = "builtin_chat"  # conversations about the built-in docs (segpack.chat_corpus)
  c.packing.seq_len = 512
  c.packing.mode = "minibatch"  # each step packs the minibatch unpacked training would draw
  c.packing.examples_per_batch = 16  # conversations per optimizer step
  # Rows per step: minibatch mode packs each minibatch into these. On the full chat corpus a
  # minibatch of 16 needs at most 8 rows of 512 (10 epochs measured); 10 leaves a margin.
  c.train.batch_size = 10
  # Length, rate and warmup by recipe (train/recipe.py; the first log line says what it chose):
  # from scratch 2 epochs (~860 steps of the full chat corpus) at 1e-3; with model.init_from
  # (fine-tuning a pretrained model) 3 epochs at 2e-5, warmup 3% of the steps, as TRL's SFT.
  c.train.num_steps = config_dict.placeholder(int)
  c.train.learning_rate = config_dict.placeholder(float)
  c.train.warmup_steps = config_dict.placeholder(int)
  c.train.eval_every = 200
  c.train.eval_batches = 0  # the whole held-out split
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """SFT with minibatch packing; `arg="smoke"` shrinks the run to seconds."""
  c = base_config()
  if arg == "smoke":
    c = packed.smoke(c)
    c.packing.seq_len = 256
    c.packing.examples_per_batch = 4  # 8 rows hold 4 conversations even when split
    c.train.eval_batches = 2
  return packed.finish(c, None if arg == "smoke" else arg)

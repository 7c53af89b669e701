"""Packed training: FFD-packed rows of the built-in corpus, segment-masked attention.

  python -m train.main --config=configs/packed.py            # a few hundred steps, ~10 min CPU
  python -m train.main --config=configs/packed.py:smoke      # seconds (small corpus, tiny model)
  python -m train.main --config=configs/packed.py --config.train.num_steps=50
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  """The full (unlocked) config; `configs/padded.py` edits a copy of it."""
  c = ml_collections.ConfigDict()

  c.data = ml_collections.ConfigDict()
  c.data.source = "builtin"  # "builtin" (Python docs + stdlib corpus) or "synthetic" (random)
  c.data.size = "full"  # builtin corpus size: "full" (vocab 8192) or "small" (vocab 2048)
  c.data.cache_dir = config_dict.placeholder(str)  # corpus cache; None: $SEGPACK_CACHE or ~/.cache
  c.data.add_bos = True  # BOS before every document
  c.data.add_eos = True  # EOS after every document
  c.data.seed = 0  # row shuffling seed (and the synthetic documents' seed)
  c.data.synthetic_docs = 2000  # synthetic source: number of documents
  c.data.synthetic_mean_len = 200  # synthetic source: median document length (log-normal)
  c.data.synthetic_vocab = 512  # synthetic source: vocabulary size

  c.packing = ml_collections.ConfigDict()
  c.packing.seq_len = 256  # slots per row
  c.packing.strategy = "ffd"  # planner: ffd, bfd, greedy, pad (one document per row), sorted_pad
  c.packing.long_docs = "split"  # documents longer than a row: "split" into chunks or "truncate"
  c.packing.max_segments_per_row = config_dict.placeholder(int)  # cap on documents per row

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = config_dict.placeholder(int)  # None: the tokenizer's vocabulary size
  c.model.num_layers = 4  # L
  c.model.d_model = 256  # E
  c.model.num_heads = 4  # H
  c.model.num_kv_heads = 2  # K (grouped-query attention)
  c.model.head_dim = 64  # D
  c.model.d_ff = 704  # F (SwiGLU hidden size, ~8/3 E rounded to 64)
  c.model.rope_theta = 10_000.0  # RoPE base
  c.model.norm_eps = 1e-6  # RMSNorm epsilon
  c.model.tie_embeddings = False  # share the input embedding and the output projection
  c.model.init_std = 0.02  # std of the normal initialisers
  c.model.dtype = "auto"  # compute dtype: "auto" = float32 on CPU, bfloat16 on GPU/TPU
  c.model.param_dtype = "float32"  # parameter (and optimizer state) dtype

  c.attention = ml_collections.ConfigDict()
  c.attention.implementation = config_dict.placeholder(str)  # None: pallas on GPU, xla elsewhere
  c.attention.interpret = False  # Pallas in interpret mode: the GPU kernels run on the CPU, slowly

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel axis size; -1: all remaining devices
  c.mesh.fsdp = 1  # parameter/optimizer sharding axis size (rows are split over it too)
  c.mesh.tensor = 1  # tensor-parallel axis size (heads / feed-forward hidden)

  c.train = ml_collections.ConfigDict()
  c.train.seed = 0  # parameter initialisation seed
  c.train.num_steps = 300  # optimizer steps
  c.train.batch_size = 8  # rows per optimizer step, over all processes and micro-batches
  c.train.grad_accum_steps = 1  # micro-batches per step (each batch_size / grad_accum_steps rows)
  c.train.learning_rate = 3e-3  # peak learning rate
  c.train.warmup_steps = 30  # linear warmup from 0
  c.train.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio
  c.train.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only)
  c.train.b1 = 0.9  # AdamW beta1
  c.train.b2 = 0.95  # AdamW beta2
  c.train.eps = 1e-8  # AdamW epsilon
  c.train.grad_clip = 1.0  # global-norm clipping threshold; 0 disables
  c.train.log_every = 10  # steps between metric lines
  c.train.eval_every = 100  # steps between held-out evaluations (and at step 0 / the end); 0: never
  c.train.eval_batches = 8  # held-out batches per evaluation; 0: the whole held-out split
  c.train.checkpoint_every = 100  # steps between checkpoints (and always at the end)
  c.train.max_checkpoints = 2  # checkpoints kept
  c.train.log_batches = True  # append per-step batch fingerprints to WORKDIR/batches*.jsonl
  return c


def smoke(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Shrinks a config to a run of a few seconds: small corpus, tiny model, 4 steps."""
  c.data.size = "small"
  c.packing.seq_len = 128
  c.model.num_layers = 2
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.d_ff = 128
  c.train.num_steps = 4
  c.train.warmup_steps = 1
  c.train.batch_size = 8
  c.train.log_every = 1
  c.train.eval_every = 2
  c.train.eval_batches = 2
  c.train.checkpoint_every = 2
  return c


def finish(c: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Applies the `:arg` variant and locks the config (typos in overrides then fail)."""
  if arg == "smoke":
    c = smoke(c)
  elif arg:
    raise ValueError(f"config argument must be empty or 'smoke', got {arg!r}")
  c.lock()
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Packed FFD rows and segment attention; `arg="smoke"` shrinks the run to seconds."""
  return finish(base_config(), arg)

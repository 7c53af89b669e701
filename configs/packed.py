"""Packed training: FFD-packed rows of the built-in corpus, segment-masked attention.

  python -m train.main --config=configs/packed.py            # a few hundred steps, ~10 min CPU
  python -m train.main --config=configs/packed.py:smoke      # seconds (small corpus, tiny model)
  python -m train.main --config=configs/packed.py:gpu        # 113M parameters, one 80 GB H100
  python -m train.main --config=configs/packed.py:long       # 131,072-slot rows over 8 GPUs
  python -m train.main --config=configs/packed.py --config.train.num_steps=50
"""

from __future__ import annotations

import dataclasses
import typing

import ml_collections
from ml_collections import config_dict

from segpack.errors import UserError
from configs import architecture


def declared_group(cls: type) -> ml_collections.ConfigDict:
  """A config group of the dataclass `cls`: one key per field, its default the field's.

  The fields are declared (with their comments) in `cls` alone; a field typed `X | None` with
  default None becomes a placeholder of `X` (so `--config.group.key=...` is typed), a field whose
  default is a dataclass becomes a nested group of its own fields.
  """
  hints = typing.get_type_hints(cls)
  group = ml_collections.ConfigDict()
  for field in dataclasses.fields(cls):
    default = (field.default_factory() if field.default is dataclasses.MISSING
               else field.default)
    if dataclasses.is_dataclass(default):
      group[field.name] = declared_group(type(default))
    elif default is None:
      kinds = [t for t in typing.get_args(hints[field.name]) if t is not type(None)]
      group[field.name] = config_dict.placeholder(kinds[0])
    else:
      group[field.name] = default
  return group


def model_group() -> ml_collections.ConfigDict:
  """The `model` group: the decoder's architecture, whose keys are the fields of
  `configs.architecture.Architecture` (declared there, with their comments), and `init_from`."""
  m = declared_group(architecture.Architecture)
  # A Hugging Face model directory (config.json, *.safetensors, tokenizer files) to start from:
  # the architecture keys then come from its config.json (an override that contradicts it is
  # refused) and the weights from its safetensors; docs/hf.md. None: random initialisation
  m.init_from = config_dict.placeholder(str)
  # With model.lora.rank > 0: a PEFT LoRA adapter directory (adapter_config.json,
  # adapter_model.safetensors) whose adapters the run starts from instead of fresh ones (B = 0);
  # its rank, alpha and targets become model.lora's (docs/adapters.md)
  m.init_adapter = config_dict.placeholder(str)
  return m


def rl_group() -> ml_collections.ConfigDict:
  """The `rl` group: RL on the run's own samples (configs/grpo.py, docs/rl.md)."""
  r = ml_collections.ConfigDict()
  # "none": no RL; "grpo", "dr_grpo", "dapo", "bnpo", "gspo" or "rloo": learn from the run's own
  # samples of the prompts of data.train (`segpack tokenize --format prompts`; docs/rl.md), the
  # loss and advantage of that name (TRL's `GRPOConfig.loss_type`; "rloo": leave-one-out)
  r.loss = "none"
  r.num_generations = 8  # completions per prompt (a group), all from one prefill
  r.prompts_per_step = 4  # prompts drawn per round of sampling
  r.max_completion_length = 128  # new tokens per completion at most
  r.temperature = 1.0  # sampling temperature (the log-probs are taken at it)
  r.top_p = 1.0  # nucleus sampling (1: off)
  r.top_k = 0  # top-k sampling (0: off)
  # "group": advantages divided by the group's reward std (GRPO); "batch": by the round's;
  # "none": not divided (Dr. GRPO); None: the loss's own ("none" for dr_grpo, else "group")
  r.scale_rewards = config_dict.placeholder(str)
  r.epsilon = 0.2  # the ratio's lower clip, r >= 1 - epsilon
  r.epsilon_high = config_dict.placeholder(float)  # upper clip; None: epsilon (dapo: 0.28)
  r.beta = 0.0  # the k3 KL term's weight to the reference (the initial weights); 0: none
  # The KL term times the ratio: its unbiased reverse-KL gradient (TRL's default)
  r.use_bias_correction_kl = True
  r.inner_steps = 1  # optimizer steps on every round's samples (TRL's num_iterations)
  # Rewards, comma-separated NAME or NAME=WEIGHT: math (math-verify against the record's
  # `answer`), gsm8k (`#### N`), gsm8k_flexible (the last number), exact (the stripped
  # completion equals `answer`), format (rl.format_pattern matches), overlong (DAPO's soft
  # over-length penalty), or a MODULE:FUNCTION of (prompt, completion, record) -> float
  r.rewards = "gsm8k"
  r.format_pattern = r"#### -?[0-9]"  # the `format` reward's regular expression (re.search)
  r.overlong_buffer = 0  # `overlong`: the last tokens before max_completion_length penalised
  # Groups whose completions all got one reward are dropped before the update (DAPO's dynamic
  # sampling); None: for dapo only
  r.drop_equal_groups = config_dict.placeholder(bool)
  # Completions cut at max_completion_length train no token (DAPO's over-long masking); None:
  # for dapo only
  r.mask_truncated = config_dict.placeholder(bool)
  # Each group's prompt stored once in its row, its completions as branches that see it and
  # never each other; False: every completion after its own copy of the prompt
  r.shared_prompt = True
  r.lanes = 0  # completions decoded at once (0: every completion of a round)
  return r


def base_config() -> ml_collections.ConfigDict:
  """The full (unlocked) config; `configs/padded.py` edits a copy of it."""
  c = ml_collections.ConfigDict()

  c.data = ml_collections.ConfigDict()
  # "builtin" (Python docs + stdlib corpus), "builtin_chat" (conversations about them,
  # configs/sft.py) or "synthetic" (random documents)
  c.data.source = "builtin"
  # A dataset directory written by `segpack tokenize` (plain or chat) to train on instead of
  # data.source, or a weighted mixture of several, "web=data/web:0.7,code=data/code:0.3" (weights:
  # shares of trained tokens); vocabulary, BOS/EOS/pad ids and the loss mask from the manifest
  c.data.train = config_dict.placeholder(str)
  # with data.train: held-out data of its own (a dataset of the same tokenizer); None: hold out
  # data.eval_share of data.train's documents, chosen by a stable hash of the document index
  c.data.eval = config_dict.placeholder(str)
  c.data.eval_share = 0.02  # with data.train and no data.eval: the held-out share of documents
  # with a mixture data.train ("web=data/web:0.7,code=data/code:0.3"): tokens drawn per mixture
  # epoch over all sources; None: all their tokens
  c.data.tokens_per_epoch = config_dict.placeholder(int)
  c.data.size = "full"  # built-in corpus size: "full" (vocab 8192) or "small" (vocab 2048)
  c.data.train_on = "assistant"  # builtin_chat loss on: "assistant", "last_assistant" or "all"
  c.data.cache_dir = config_dict.placeholder(str)  # corpus cache; None: $SEGPACK_CACHE or ~/.cache
  c.data.add_bos = True  # BOS before every document
  c.data.add_eos = True  # EOS after every document
  c.data.seed = 0  # row shuffling seed (and the synthetic documents' seed)
  c.data.synthetic_docs = 2000  # synthetic source: number of documents
  c.data.synthetic_mean_len = 200  # synthetic source: median document length (log-normal)
  c.data.synthetic_vocab = 512  # synthetic source: vocabulary size

  c.packing = ml_collections.ConfigDict()
  c.packing.seq_len = 256  # slots per row
  c.packing.strategy = "ffd"  # packer: ffd, bfd, greedy, pad (one document per row), sorted_pad
  c.packing.long_docs = "split"  # LongDocs.mode: documents longer than a row "split" or "truncate"
  c.packing.max_segments_per_row = config_dict.placeholder(int)  # cap on documents per row
  # "attention": deal each global batch's rows to the data-parallel ranks so that their summed
  # attention cost (sum of l(l+1)/2 per row) is even (docs/packing.md); "none": epoch order
  c.packing.balance = "none"
  # "epoch": every epoch after the first gets its own exact plan, so documents meet new
  # neighbours each epoch (ffd, bfd, sorted_pad; not with max_segments_per_row); "none": one plan
  c.packing.repack = "none"
  # "global": the rows of one plan per epoch; "minibatch": every step packs the minibatch that
  # unpacked sampling would draw (chat fine-tuning, docs/sft.md)
  c.packing.mode = "global"
  c.packing.examples_per_batch = config_dict.placeholder(int)  # minibatch mode: examples per step
  c.packing.tokens_per_batch = config_dict.placeholder(int)  # minibatch mode: or tokens per step
  # With mesh.context > 1, the slot order that evens out the attention work of a row's devices
  # (segpack/data/context_order.py): "zigzag" (device i gets chunks i and 2*context-1-i of
  # 2*context, exact for one document filling the row), "documents" (chunks paired by their causal
  # cost, best for rows of many documents) or "none" (consecutive slots: the last device does the
  # most work). Only the order of slots changes, never the data or the loss; ignored at context 1.
  c.packing.context_balance = "documents"

  c.model = model_group()

  c.attention = ml_collections.ConfigDict()
  c.attention.implementation = config_dict.placeholder(str)  # None: pallas on GPU, xla elsewhere
  c.attention.interpret = False  # Pallas in interpret mode: the GPU kernels run on the CPU, slowly
  # Before the first step, check the backend against per-document XLA runs on a tiny packed batch
  # (output and gradients; `segpack.attention.self_check`, ~1 s) and refuse to train on a leak.
  c.attention.self_check = True

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel axis size; -1: all remaining devices
  c.mesh.fsdp = 1  # parameter/optimizer sharding axis size (rows are split over it too)
  c.mesh.tensor = 1  # tensor-parallel axis size (heads / feed-forward hidden)
  # context-parallel axis size: every row's slots are split over this many devices (long rows;
  # packing.seq_len must divide by 2 * context, by context with packing.context_balance="none")
  c.mesh.context = 1

  c.loss = ml_collections.ConfigDict()
  # "token": every trained token weighs alike (sum of token losses / trained tokens); "sequence":
  # every document (segment) alike, the mean of per-document mean losses, as unpacked
  # per-sequence training computes it; a chunk of a split document weighs as its own sequence.
  # Changes the objective, so a run cannot resume with another value (docs/training.md).
  c.loss.weighting = "token"
  # Positions per block of the blocked cross-entropy (segpack/loss/blocks.py): > 0 computes the
  # loss from the final hidden states a block at a time, never the whole [batch, seq, vocab]
  # logits (forward or backward; counted per device); 0: the full logits. Same loss and gradients
  c.loss.block_size = 0
  # With loss.block_size > 0: vocabulary columns per chunk of a block (an online logsumexp), so
  # the largest temporary is [block_size, vocab_block_size] floats; 0: the whole vocabulary
  c.loss.vocab_block_size = 0

  c.preference = ml_collections.ConfigDict()
  # "none": train on tokens (pretraining, SFT); "dpo", "ipo", "simpo" or "orpo": train on the
  # preference pairs of data.train (`segpack tokenize --format preference`; docs/preference.md)
  c.preference.loss = "none"
  # The losses' beta: DPO's and IPO's strength of the reference (IPO's tau), SimPO's reward
  # scale, ORPO's weight of the odds-ratio term
  c.preference.beta = 0.1
  # "dpo": the share of preference labels taken as flipped (conservative DPO); 0: plain DPO
  c.preference.label_smoothing = 0.0
  # "simpo": the target reward margin gamma
  c.preference.simpo_gamma = 0.5
  # Each pair's prompt stored once in its row, chosen and rejected as two branches that see it
  # and never each other (segment attention with a shared prefix); fewer slots per pair
  c.preference.shared_prefix = False
  # A pair longer than packing.seq_len: False refuses it by name; True cuts both sequences to
  # their first slots (pairs left without a completion token are dropped; both are counted)
  c.preference.truncate = False
  # Where "dpo" and "ipo" read the reference's log-probs: "init" scores every pair once with the
  # initial weights (model.init_from, the usual SFT model) before the first step, into
  # WORKDIR/reference; or a directory written by `python -m train.preference.score` for another model
  c.preference.reference = "init"

  c.rl = rl_group()

  c.train = ml_collections.ConfigDict()
  c.train.seed = 0  # parameter initialisation seed
  # Optimizer steps; None: the recipe's epochs (train/recipe.py: 3 when fine-tuning a model.init_from)
  c.train.num_steps = 300
  # The run's length in epochs of the training data, resolved to num_steps (which it replaces) from
  # the data's rows per epoch and printed; None: train.num_steps
  c.train.num_epochs = config_dict.placeholder(float)
  c.train.batch_size = 8  # rows per optimizer step, over all processes and micro-batches
  c.train.grad_accum_steps = 1  # micro-batches per step (each batch_size / grad_accum_steps rows)
  # Resuming with another batch_size is refused unless this is True; then the run continues
  # from the same row of the data stream with the new batch size (docs/training.md).
  c.train.allow_batch_size_change = False
  # Peak learning rate; None: the recipe's (train/recipe.py: 1e-3 from scratch, 2e-5 fine-tuning
  # a model.init_from; a rate above 1e-4 on a pretrained model is warned about)
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 30  # linear warmup from 0; None: the recipe's share of the steps
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
  # Peak FLOP/s of one device for the logged MFU; None: from the device kind (bf16 dense peak of
  # H100/H200/A100, see train/model/flops.py), else MFU is logged as n/a (CPU, other GPUs, float32).
  c.train.peak_flops = config_dict.placeholder(float)
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


def gpu(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A 113M-parameter decoder on 4096-slot rows for one 80 GB H100 (bf16 compute, Pallas).

  Parameters (vocabulary V = 8192 of the full built-in corpus, untied output projection): per layer
  attention E*H*D + 2*E*K*D + H*D*E = 1,572,864, SwiGLU 3*E*F = 4,718,592, norms 2*E = 1,536, so
  6,292,992; 16 layers 100,687,872; embedding and output projection 2*V*E = 12,582,912; final norm
  768: 113,271,552 in all, 106,954,752 of them in matmuls (the FLOP count's N, train/model/flops.py).

  Memory of one step (how it fits in 80 GB): docs/training.md, "The `:gpu` config's memory".

  The built-in corpus is 3.84M tokens per epoch, ~940 rows of 4096, so ~59 steps per epoch: 240
  steps are ~4 epochs (~15.7M tokens), a short run; repeating data much longer overfits a model
  of this size. Learning rate and warmup are the usual ones for ~100M-parameter GPT-style models.
  """
  c.data.size = "full"
  c.packing.seq_len = 4096
  c.model.num_layers = 16  # L
  c.model.d_model = 768  # E
  c.model.num_heads = 12  # H
  c.model.num_kv_heads = 4  # K
  c.model.head_dim = 64  # D
  c.model.d_ff = 2048  # F (8/3 E)
  c.model.dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.attention.implementation = "pallas"
  c.train.batch_size = 16  # rows per step: 65,536 slots
  c.train.grad_accum_steps = 2  # micro-batches of 8 rows: one of 16 needs ~79 GB (XLA estimate)
  c.train.num_steps = 240
  c.train.learning_rate = 6e-4
  c.train.warmup_steps = 24
  c.train.log_every = 10
  c.train.eval_every = 60  # about once per epoch
  c.train.eval_batches = 0  # the whole held-out split
  c.train.checkpoint_every = 60
  return c


def long(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The `:gpu` model on 131,072-slot rows, every row split over 8 GPUs (context parallelism).

  `mesh.context=8`: each GPU holds 16,384 slots of a row (in the `documents` balance order,
  docs/training.md, "Context parallelism") and all-gathers the row's keys and values in every
  layer's Pallas attention. Parameters and optimizer state are replicated on the 8 GPUs (2.3 GB
  each); memory per GPU: docs/training.md, "The `:long` config's memory". A step is 2 rows
  (262,144 slots) in 2 micro-batches of one row; the built-in corpus (~3.84M tokens) is ~29
  rows, so ~15 steps per epoch and 60 steps ~4 epochs, as `:gpu`.
  """
  c = gpu(c)
  c.packing.seq_len = 131_072
  c.packing.context_balance = "documents"
  c.mesh.data = 1
  c.mesh.context = 8
  c.train.batch_size = 2
  c.train.grad_accum_steps = 2
  c.train.num_steps = 60
  c.train.warmup_steps = 6
  c.train.eval_every = 15  # about once per epoch
  c.train.checkpoint_every = 15
  return c


VARIANTS = {"smoke": smoke, "gpu": gpu, "long": long}


class UnknownVariantError(UserError, ValueError):
  """`--config=FILE:VARIANT` names no variant of `VARIANTS`."""


def finish(c: ml_collections.ConfigDict, arg: str | None) -> ml_collections.ConfigDict:
  """Applies the `:arg` variant and locks the config (typos in overrides then fail).

  Raises:
    UnknownVariantError: `arg` is neither empty nor a key of `VARIANTS`.
  """
  if arg in VARIANTS:
    c = VARIANTS[arg](c)
  elif arg:
    raise UnknownVariantError(f"unknown config variant {arg!r}: the variants are "
                              f"{sorted(VARIANTS)} (--config=FILE:VARIANT), or none")
  c.lock()
  return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Packed FFD rows and segment attention; `arg="smoke"` shrinks the run to seconds, `arg="gpu"`
  grows it to a 113M-parameter model on one H100, `arg="long"` puts that model on 131,072-slot
  rows split over 8 GPUs."""
  return finish(base_config(), arg)

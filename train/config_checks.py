"""`check_config(config)`: every string-choice and numeric key of a trainer config checked in one
place.

Each key's choices are one tuple: the library's own where it has one (`segpack.packing.STRATEGIES`,
`segpack.data.packed.REPACK_MODES`, `segpack.loss.WEIGHTINGS`, ...), else one defined here (the
trainer-only keys `data.source`, `packing.mode`, `packing.balance`). `train.setup.setup` calls
`check_config` before anything else, so a misspelt value stops the run at once with an error
that names the key, echoes the value and lists the choices, instead of deep inside the data or
model code (or after the corpus was built).

Each numeric key's rule is one `Rule` of `NUMERIC` (a bound, or None allowed where None means a
default): a value outside it stops the run with an error naming the key, the value and the rule,
instead of a `ZeroDivisionError`, an empty loop or a run that keeps no checkpoint.
`check_vocab_size` resolves `model.vocab_size` against the data's vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from segpack import attention as attention_lib
from segpack import loss as loss_lib
from segpack import packing
from segpack.loss import policy as policy_loss
from segpack.loss import preference as preference_loss
from segpack.data.context_order import CONTEXT_BALANCES
from segpack.data.packed import REPACK_MODES
from segpack.errors import UserError
from segpack.text import chat
from segpack.text import corpus
from configs import architecture
from train.hf import config as hf_config
from train.rl import settings as rl_settings
from train.model import config as model_config

# `data.source`: the built-in text corpus, the built-in chat corpus, or random documents.
SOURCES = ("builtin", "builtin_chat", "synthetic")
# `packing.mode`: rows of one plan per epoch, or one packed minibatch per step.
PACKING_MODES = ("global", "minibatch")
# `packing.balance`: epoch order, or global batches dealt to the ranks by attention cost.
BALANCE_MODES = ("none", "attention")
_DTYPES = tuple(model_config.DTYPES)
# `rl.loss`: segpack.loss.policy's losses, and RLOO's leave-one-out advantage (GRPO's loss)
RL_LOSSES = policy_loss.LOSS_TYPES + ("rloo",)
SCALE_REWARDS = ("group", "batch", "none")  # `rl.scale_rewards`, TRL's names

# Every string-choice key of the config (`group.name`) and its choices.
CHOICES: dict[str, tuple[Any, ...]] = {
    "data.source": SOURCES,
    "data.size": tuple(corpus.SIZES),
    "data.train_on": chat.TRAIN_ON,
    "packing.strategy": tuple(sorted(packing.STRATEGIES)),
    "packing.long_docs": packing.LONG_DOC_MODES,
    "packing.balance": BALANCE_MODES,
    "packing.repack": REPACK_MODES,
    "packing.mode": PACKING_MODES,
    "packing.context_balance": CONTEXT_BALANCES,
    "model.dtype": ("auto",) + _DTYPES,
    "model.param_dtype": _DTYPES,
    "model.family": hf_config.FAMILIES,
    "model.rope_scaling.type": (None,) + architecture.ROPE_SCALINGS,
    "model.remat": architecture.REMATS,
    "model.lora.base_dtype": architecture.LORA_BASE_DTYPES,
    "attention.implementation": (None,) + attention_lib.IMPLEMENTATIONS,
    "loss.weighting": loss_lib.WEIGHTINGS,
    "preference.loss": ("none",) + preference_loss.LOSSES,
    "rl.loss": ("none",) + RL_LOSSES,
    "rl.scale_rewards": (None,) + SCALE_REWARDS,
}


@dataclasses.dataclass(frozen=True)
class Rule:
  """A numeric key's allowed values: `low <= value` (`low < value` with `open_low`), `value <= high`
  (`value < high` with `open_high`), always finite; None too with `optional`."""

  low: float
  high: float = math.inf
  open_low: bool = False
  open_high: bool = False
  optional: bool = False

  def allows(self, value: Any) -> bool:
    """Whether `value` keeps the rule (a bool or a non-number never does)."""
    if value is None:
      return self.optional
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      return False
    above = value > self.low if self.open_low else value >= self.low
    below = value < self.high if self.open_high else value <= self.high
    return above and below

  def describe(self) -> str:
    """The rule in words, for errors: "in [0, 1)", "a finite number >= 1 or None"."""
    if self.high == math.inf:
      text = f"a finite number {'>' if self.open_low else '>='} {self.low:g}"
    else:
      text = (f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}"
              f"{')' if self.open_high else ']'}")
    return text + (" or None" if self.optional else "")


_POSITIVE = Rule(1)  # >= 1: a count that must not be zero
_COUNT = Rule(0)  # >= 0: a count where 0 means "never" / "all" (see configs/packed.py)
_OPTIONAL_POSITIVE = Rule(1, optional=True)  # None: the default; else >= 1

# Every numeric key of the config (`group.name`) whose bad values would crash later or silently
# change the run, and its rule. Model sizes are `model.DecoderConfig`'s (`ModelConfigError`), mesh
# sizes `sharding.make_mesh`'s (`MeshConfigError`), and `model.vocab_size` `check_vocab_size`'s.
NUMERIC: dict[str, Rule] = {
    "data.eval_share": Rule(0, 1, open_high=True),
    "data.tokens_per_epoch": _OPTIONAL_POSITIVE,
    "data.synthetic_docs": _POSITIVE,
    "data.synthetic_mean_len": _POSITIVE,
    "data.synthetic_vocab": Rule(4),  # ids 0-2 are pad/BOS/EOS; documents draw from [3, vocab)
    "packing.seq_len": Rule(2),  # inputs and labels are the row shifted by one
    "packing.max_segments_per_row": _OPTIONAL_POSITIVE,
    "packing.examples_per_batch": _OPTIONAL_POSITIVE,
    "packing.tokens_per_batch": _OPTIONAL_POSITIVE,
    "train.num_steps": _OPTIONAL_POSITIVE,  # None: the recipe's (train/recipe.py)
    "train.num_epochs": Rule(0, open_low=True, optional=True),
    "train.batch_size": _POSITIVE,
    "train.grad_accum_steps": _POSITIVE,
    "train.learning_rate": Rule(0, optional=True),
    "train.warmup_steps": Rule(0, optional=True),
    "train.min_lr_ratio": Rule(0, 1),
    "train.weight_decay": _COUNT,
    "train.b1": Rule(0, 1, open_high=True),
    "train.b2": Rule(0, 1, open_high=True),
    "train.eps": Rule(0, open_low=True),  # 0 divides 0 by 0 for a parameter with no gradient yet
    "train.grad_clip": _COUNT,  # 0: no clipping
    "train.log_every": _POSITIVE,
    "train.eval_every": _COUNT,  # 0: never evaluate
    "train.eval_batches": _COUNT,  # 0: the whole held-out split
    "train.checkpoint_every": _COUNT,  # 0: only at the end
    "train.max_checkpoints": _POSITIVE,  # 0 would keep none, so a rerun starts from scratch
    "train.peak_flops": Rule(0, open_low=True, optional=True),
    "model.sliding_window": _OPTIONAL_POSITIVE,
    "model.max_position_embeddings": _OPTIONAL_POSITIVE,
    "model.rope_scaling.factor": Rule(0, open_low=True),
    "model.lora.rank": _COUNT,  # 0: no adapters
    "model.lora.alpha": Rule(0, open_low=True),
    "model.lora.dropout": Rule(0, 1, open_high=True),
    "loss.block_size": _COUNT,  # 0: the full logits
    "loss.vocab_block_size": _COUNT,  # 0: the whole vocabulary per block
    "preference.beta": Rule(0, open_low=True),
    "preference.label_smoothing": Rule(0, 0.5, open_high=True),  # 0.5: no preference left
    "preference.simpo_gamma": Rule(0),
    "rl.num_generations": _POSITIVE,
    "rl.prompts_per_step": _POSITIVE,
    "rl.max_completion_length": _POSITIVE,
    "rl.temperature": Rule(0, open_low=True),
    "rl.top_p": Rule(0, 1, open_low=True),
    "rl.top_k": _COUNT,
    "rl.epsilon": Rule(0, 1, open_high=True),
    "rl.epsilon_high": Rule(0, optional=True),
    "rl.beta": Rule(0),
    "rl.inner_steps": _POSITIVE,
    "rl.overlong_buffer": _COUNT,
    "rl.lanes": _COUNT,
}


class ConfigError(UserError, ValueError):
  """A trainer config key holds a value outside its choices or its numeric rule."""


def check_choice(key: str, value: Any, choices: tuple[Any, ...], *,
                 error: type[ValueError] = ConfigError) -> None:
  """Raises `error` naming `key`, echoing `value` and listing `choices` unless `value` is one."""
  if value not in choices:
    raise error(f"{key} must be one of {list(choices)}, got {value!r}")


def check_rule(key: str, value: Any, rule: Rule) -> None:
  """Raises `ConfigError` naming `key`, echoing `value` and describing `rule` unless it allows
  `value`."""
  if not rule.allows(value):
    raise ConfigError(f"{key} must be {rule.describe()}, got {value!r}")


def _value(config: Any, key: str) -> Any:
  """The value of a dotted key (`model.rope_scaling.type`)."""
  for part in key.split("."):
    config = config[part]
  return config


def check_config(config: Any) -> None:
  """Checks every key of `CHOICES` and `NUMERIC` in a trainer config
  (`configs/packed.py:get_config()`).

  Raises:
    ConfigError: the first key whose value is not one of its choices or breaks its rule.
  """
  for key, choices in CHOICES.items():
    check_choice(key, _value(config, key), choices)
  for key, rule in NUMERIC.items():
    check_rule(key, _value(config, key), rule)
  check_data(config)
  check_minibatch(config)
  check_preference(config)
  rl_settings.check(config)
  check_context(config)
  check_model(config)


def check_model(config: Any) -> None:
  """Runs the model's own checks (`train.model.config.DecoderConfig`, `RopeScaling`) on the `model`
  group before anything is built; the vocabulary size, known from the data only, stands in as 1
  when unset (`check_vocab_size` checks it then).

  Raises:
    ModelConfigError: sizes that are not positive ints, heads that do not divide into KV heads,
      an odd head size, a RoPE scaling without its factors.
  """
  try:
    model_config.DecoderConfig(
        **dict(model_config.architecture_fields(config.model),
               vocab_size=config.model.vocab_size or 1),
        attention_implementation="xla")
  except model_config.ModelConfigError as e:  # the fields are the config's model.* keys
    raise model_config.ModelConfigError(str(e).replace("DecoderConfig.", "model.")) from e


def check_data(config: Any) -> None:
  """Checks that `data.train` and `data.eval` name one training set.

  Raises:
    ConfigError: `data.train` with `data.source="synthetic"` (data.train replaces the built-in
      sources, not random documents), or `data.eval` without `data.train`.
  """
  d = config.data
  if d.train is not None and d.source == "synthetic":
    raise ConfigError(
        f"data.train={d.train!r} and data.source={d.source!r} name two training sets; "
        f"data.train replaces data.source: leave data.source at its default")
  if d.train is None and d.eval is not None:
    raise ConfigError(f"data.eval={d.eval!r} is for data.train; set data.train too")


def check_preference(config: Any) -> None:
  """Checks the keys a preference loss does not combine with.

  Raises:
    ConfigError: a preference loss without data.train, with packing.mode="minibatch" (pairs
      are packed globally, whole), with mesh.context > 1, or with packing.max_segments_per_row.
  """
  p = config.preference
  if p.loss == "none":
    return
  clash = [(k, v, ok) for k, v, ok in (
      ("data.train", config.data.train, config.data.train is not None),
      ("packing.mode", config.packing.mode, config.packing.mode == "global"),
      ("mesh.context", config.mesh.context, config.mesh.context == 1),
      ("packing.max_segments_per_row", config.packing.max_segments_per_row,
       config.packing.max_segments_per_row is None)) if not ok]
  if clash:
    key, value, _ = clash[0]
    raise ConfigError(
        f"preference.loss={p.loss!r} with {key}={value!r}: a preference loss trains on the "
        f"whole pairs of one preference dataset (data.train, from `segpack tokenize --format "
        f"preference`), packed globally (packing.mode='global'), one row per device "
        f"(mesh.context=1), without a segment cap")


def check_minibatch(config: Any) -> None:
  """Checks the keys that `packing.mode="minibatch"` does not combine with.

  Raises:
    ConfigError: `packing.balance` or `packing.repack` other than "none" (minibatch mode keeps
      each step's examples as unpacked sampling draws them, packed afresh), a
      `packing.max_segments_per_row` cap, or a `packing.tokens_per_batch` that does not make
      `train.batch_size` rows of `packing.seq_len`.
  """
  p = config.packing
  if p.mode != "minibatch":
    return
  if p.balance != "none":
    raise ConfigError(
        f"packing.balance={p.balance!r} is for packing.mode='global' (minibatch mode keeps each "
        f"step's examples as unpacked sampling draws them); set packing.balance='none'")
  if p.repack != "none":
    raise ConfigError(
        f"packing.repack={p.repack!r} is for packing.mode='global' (minibatch mode packs every "
        f"minibatch afresh already); set packing.repack='none'")
  if p.max_segments_per_row is not None:
    raise ConfigError(f"packing.max_segments_per_row={p.max_segments_per_row} is not supported "
                      f"with packing.mode='minibatch'")
  batch_size = config.train.batch_size
  if p.tokens_per_batch is not None and p.tokens_per_batch // p.seq_len != batch_size:
    raise ConfigError(
        f"packing.tokens_per_batch={p.tokens_per_batch} gives {p.tokens_per_batch // p.seq_len} "
        f"rows of seq_len {p.seq_len} per step, but train.batch_size={batch_size}; make them "
        f"agree")


def check_context(config: Any) -> None:
  """Checks `mesh.context` against `packing.seq_len`, `packing.context_balance` and the attention.

  A row's slots are split into `mesh.context` equal shares, each of two chunks unless
  `packing.context_balance` is "none" (`segpack.data.context_order.context_order`); cuDNN
  attention has no context-parallel form.

  Raises:
    ConfigError: `mesh.context` is not a positive int, `packing.seq_len` does not divide, or
      `attention.implementation` is "cudnn" with `mesh.context` > 1.
  """
  cp, seq_len = config.mesh.context, config.packing.seq_len
  balance = config.packing.context_balance
  if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
    raise ConfigError(f"mesh.context must be a positive int (no -1), got {cp!r}")
  if cp == 1:
    return
  chunks = 1 if balance == "none" else 2
  if seq_len % (chunks * cp):
    raise ConfigError(
        f"packing.seq_len={seq_len} must be divisible by {'' if chunks == 1 else '2 * '}"
        f"mesh.context = {chunks * cp} with packing.context_balance={balance!r}")
  if config.attention.implementation == "cudnn":
    raise ConfigError(f"attention.implementation='cudnn' has no context-parallel form; with "
                      f"mesh.context={cp} use 'pallas' or 'xla'")


def check_vocab_size(config: Any, data_vocab_size: int) -> int:
  """The model's vocabulary size: `model.vocab_size`, or the data's when it is None.

  Args:
    config: a trainer config.
    data_vocab_size: the data's vocabulary size (`train.data.Data.vocab_size`, its largest id + 1).

  Raises:
    ConfigError: `model.vocab_size` is smaller than the data's vocabulary (or not an int).
  """
  value = config.model.vocab_size
  if value is None:
    return int(data_vocab_size)
  if isinstance(value, bool) or not isinstance(value, int) or value < data_vocab_size:
    raise ConfigError(
        f"model.vocab_size must be None (the data's) or at least the data's vocabulary size "
        f"{data_vocab_size}, got {value!r}")
  return value


class AttentionConfigError(UserError, ValueError):
  """The `attention` group asks for a backend this platform cannot run, or a setting it ignores."""


def check_attention(attention_cfg: Any, *, platform: str) -> str:
  """Resolves the backend of the `attention` group once, for the run (returned: its name), and
  refuses what `segpack.attention.resolve_implementation` refuses (it holds the rules, e.g. Pallas
  on the CPU only in interpret mode), naming the config keys (JAX's own error names none)."""
  try:
    return attention_lib.resolve_implementation(
        implementation=attention_cfg.implementation, platform=platform,
        pallas=model_config.pallas_options(attention_cfg))
  except attention_lib.AttentionInputError as e:
    raise AttentionConfigError(
        f"attention.implementation={attention_cfg.implementation!r} with attention.interpret="
        f"{bool(attention_cfg.interpret)} on the {platform!r} platform: {e} (config keys: "
        "`implementation` is attention.implementation, and `pallas.interpret=True` is "
        "attention.interpret=True)") from e


def check_attention_leaks(config: Any, *,
                          implementation: str) -> attention_lib.SelfCheckResult | None:
  """Unless `attention.self_check` is False, runs `segpack.attention.self_check` on the configured
  backend (`implementation`, as `check_attention` resolved it; with `attention.interpret`, in the
  model's compute dtype) and lets its `AttentionLeakError` stop the run before any work."""
  a = config.attention
  if not a.self_check:
    return None
  return attention_lib.self_check(implementation=implementation,
                                  pallas=model_config.pallas_options(a),
                                  dtype=model_config.compute_dtype(config.model.dtype))

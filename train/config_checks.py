"""`check_config(config)`: every string-choice key of a trainer config checked in one place.

Each key's choices are one tuple: the library's own where it has one (`segpack.packing.STRATEGIES`,
`segpack.data.packed.REPACK_MODES`, `segpack.loss.WEIGHTINGS`, ...), else one defined here (the
trainer-only keys `data.source`, `packing.mode`, `packing.balance`). `train.train.setup` calls
`check_config` before anything else, so a misspelt value stops the run at once with an error
that names the key, echoes the value and lists the choices, instead of deep inside the data or
model code (or after the corpus was built).
"""

from __future__ import annotations

from typing import Any

from segpack import attention as attention_lib
from segpack import loss as loss_lib
from segpack import packing
from segpack.data.packed import REPACK_MODES
from segpack.text import chat
from segpack.text import corpus
from train import model as model_lib

# `data.source`: the built-in text corpus, the built-in chat corpus, or random documents.
SOURCES = ("builtin", "builtin_chat", "synthetic")
# `packing.mode`: rows of one plan per epoch, or one packed minibatch per step.
PACKING_MODES = ("global", "minibatch")
# `packing.balance`: epoch order, or global batches dealt to the ranks by attention cost.
BALANCE_MODES = ("none", "attention")
_DTYPES = tuple(model_lib.DTYPES)

# Every string-choice key of the config (`group.name`) and its choices.
CHOICES: dict[str, tuple[Any, ...]] = {
    "data.source": SOURCES,
    "data.size": tuple(corpus.SIZES),
    "data.train_on": chat.TRAIN_ON,
    "packing.strategy": tuple(sorted(packing.STRATEGIES)),
    "packing.long_docs": packing.LONG_DOCS,
    "packing.balance": BALANCE_MODES,
    "packing.repack": REPACK_MODES,
    "packing.mode": PACKING_MODES,
    "model.dtype": ("auto",) + _DTYPES,
    "model.param_dtype": _DTYPES,
    "attention.implementation": (None,) + attention_lib.IMPLEMENTATIONS,
    "loss.weighting": loss_lib.WEIGHTINGS,
}


class ConfigError(ValueError):
  """A trainer config key holds a value outside its choices."""


def check_choice(key: str, value: Any, choices: tuple[Any, ...], *,
                 error: type[ValueError] = ConfigError) -> None:
  """Raises `error` naming `key`, echoing `value` and listing `choices` unless `value` is one."""
  if value not in choices:
    raise error(f"{key} must be one of {list(choices)}, got {value!r}")


def check_config(config: Any) -> None:
  """Checks every key of `CHOICES` in a trainer config (`configs/packed.py:get_config()`).

  Raises:
    ConfigError: the first key whose value is not one of its choices.
  """
  for key, choices in CHOICES.items():
    group, name = key.split(".")
    check_choice(key, config[group][name], choices)

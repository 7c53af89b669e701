"""The run's length and learning rate, resolved once from the config and the data.

A config may leave `train.learning_rate`, `train.warmup_steps` and `train.num_steps` unset (None:
configs/sft.py does) and may give the length in epochs (`train.num_epochs`). `resolve` fills them
from one of two recipes, chosen by whether the run starts from a pretrained model
(`model.init_from`):

  * from scratch (`SCRATCH`): the config's own from-scratch values;
  * fine-tuning (`FINETUNE`): the rates peers use for full fine-tuning of a pretrained model
    (TRL's SFT default learning rate 2e-5, warmup 3% of the steps, 3 epochs), so that the
    README's fine-tuning commands do not wreck what the model knew; with LoRA adapters
    (`ADAPTERS`) 2e-4, PEFT's and the QLoRA paper's rate.

A value the user sets is kept; a from-scratch-sized learning rate on a pretrained model is kept
too, with one warning line (`FINETUNE.warn_above`). The resolution is printed in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

from segpack.errors import ArgumentError

__all__ = ["ADAPTERS", "FINETUNE", "Recipe", "Resolved", "SCRATCH", "resolve", "resolve_config"]


@dataclasses.dataclass(frozen=True)
class Recipe:
  """Defaults for what a config leaves unset.

  Attributes:
    name: "from scratch" or "fine-tuning".
    peak_rate: the peak learning rate (`train.learning_rate` when unset).
    warmup_fraction: warmup steps as a fraction of the run's steps.
    epochs: the run's length when neither `train.num_steps` nor `train.num_epochs` is set.
    warn_above: a learning rate above this draws a warning (None: never).
  """

  name: str
  peak_rate: float
  warmup_fraction: float
  epochs: float
  warn_above: float | None = None


SCRATCH = Recipe(name="from scratch", peak_rate=1e-3, warmup_fraction=0.05, epochs=2.0)
FINETUNE = Recipe(name="fine-tuning", peak_rate=2e-5, warmup_fraction=0.03, epochs=3.0,
                  warn_above=1e-4)
# LoRA / QLoRA (`model.lora.rank` > 0): the adapters start at zero and train at about ten times
# full fine-tuning's rate (PEFT's and the QLoRA paper's 2e-4)
ADAPTERS = Recipe(name="LoRA fine-tuning", peak_rate=2e-4, warmup_fraction=0.03, epochs=3.0,
                  warn_above=2e-3)


@dataclasses.dataclass(frozen=True)
class Resolved:
  """The resolved length and rate of a run, and what to print.

  Attributes:
    values: `{"learning_rate", "warmup_steps", "num_steps"}`: what the run's `train` group is
      given (`apply` writes them).
    epochs: the run's length in epochs (from the steps when given in steps).
    recipe: the recipe that filled what the config left unset.
    line: the one log line saying so.
    warning: a one-line warning, or None.
  """

  values: dict[str, Any]
  epochs: float
  recipe: Recipe
  line: str
  warning: str | None = None

  def apply(self, train_cfg: Any) -> None:
    """Writes `values` into the config's `train` group (unlocked for the moment)."""
    with train_cfg.unlocked() if hasattr(train_cfg, "unlocked") else _nothing():
      for key, value in self.values.items():
        train_cfg[key] = value


@contextlib.contextmanager
def _nothing():
  yield


def _positive(value: Any, key: str) -> None:
  if value is not None and not (isinstance(value, (int, float)) and value > 0):
    raise ArgumentError(f"{key} must be a positive number, got {value!r}")


def resolve(train_cfg: Any, *, init_from: str | None, steps_per_epoch: float,
            adapters: bool = False, started: dict[str, Any] | None = None) -> Resolved:
  """Fills `train.learning_rate`, `warmup_steps` and `num_steps` where the config leaves them
  None, from `FINETUNE` when `init_from` is set, else `SCRATCH`.

  `num_steps` comes from `train.num_epochs` when that is set (it replaces the config's
  `num_steps`), else from the recipe's epochs when `num_steps` is None. Steps are
  `ceil(epochs * steps_per_epoch)`.

  Args:
    train_cfg: the config's `train` group (`learning_rate`, `warmup_steps`, `num_steps`,
      `num_epochs`).
    init_from: `model.init_from` (None or empty: from scratch).
    steps_per_epoch: optimizer steps in one epoch of the training data (> 0).
    adapters: the run trains LoRA adapters (`ADAPTERS` then, with `init_from`).
    started: on a resume, the resolved `train` group the run started with (`WORKDIR/run.json`):
      a warmup the recipe chose then is kept when the length changes (a warmup re-derived from
      the new length would be another schedule for the steps already taken), and the new
      length is said in the line.

  Raises:
    ArgumentError: a non-positive value (naming its key).
  """
  if not steps_per_epoch > 0:
    raise ArgumentError(f"steps_per_epoch must be positive, got {steps_per_epoch!r}")
  recipe = (ADAPTERS if adapters else FINETUNE) if init_from else SCRATCH
  lr, warmup = train_cfg.learning_rate, train_cfg.warmup_steps
  steps, epochs = train_cfg.num_steps, train_cfg.num_epochs
  for key, value in (("num_steps", steps), ("num_epochs", epochs)):
    _positive(value, f"train.{key} (--config.train.{key})")
  given = []
  if epochs is not None or steps is None:
    given += ["num_epochs"] if epochs is not None else []
    epochs = recipe.epochs if epochs is None else float(epochs)
    steps = max(1, math.ceil(epochs * steps_per_epoch))
  else:
    epochs = steps / steps_per_epoch
    given.append("num_steps")
  if lr is None:
    lr = recipe.peak_rate
  else:
    given.append("learning_rate")
  resumed = ""
  if started and started.get("num_steps") not in (None, steps):
    resumed = (f"; resumed with {steps} steps, the run started with {started['num_steps']}: the "
               f"decay now ends at step {steps}")
  if warmup is None and started and isinstance(started.get("warmup_steps"), int):
    warmup = started["warmup_steps"]  # the recipe's warmup of the run resumed
    resumed += f", warmup {warmup} steps as it started" if resumed else ""
  elif warmup is None:
    warmup = min(steps - 1, max(1, round(recipe.warmup_fraction * steps))) if steps > 1 else 0
  line = (f"recipe: {recipe.name}{' (model.init_from)' if init_from else ''}: learning rate "
          f"{lr:g}, warmup {warmup} steps, {steps} steps = {epochs:.2f} epochs of "
          f"{steps_per_epoch:g} steps" + (f" ({', '.join(given)} as configured)" if given else "")
          + resumed)
  warning = None
  if recipe.warn_above is not None and lr > recipe.warn_above:
    warning = (f"train.learning_rate={lr:g} on a pretrained model (model.init_from) is a "
               f"from-scratch rate; {recipe.name} uses about {recipe.peak_rate:g} "
               f"(leave it unset for that)")
  return Resolved(values={"learning_rate": float(lr), "warmup_steps": int(warmup),
                          "num_steps": int(steps)},
                  epochs=float(epochs), recipe=recipe, line=line, warning=warning)


def resolve_config(config: Any, *, steps_per_epoch: float,
                   started: dict[str, Any] | None = None) -> Resolved:
  """`resolve` for a whole run config (`train` and `model.init_from`; `started` as there),
  written into its `train` group; returns what was chosen (the trainer's first lines print
  `line` and `warning`)."""
  resolved = resolve(config.train, init_from=config.model.init_from,
                     steps_per_epoch=steps_per_epoch, adapters=bool(config.model.lora.rank),
                     started=started)
  resolved.apply(config.train)
  return resolved

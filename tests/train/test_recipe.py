"""The run's length and learning rate resolved from the config and the data (train/recipe.py):
a fine-tuning recipe for a pretrained model, the user's values kept, epochs turned into steps."""

import ml_collections
import pytest

from segpack.errors import ArgumentError
from train import recipe


def train_cfg(**values):
  base = dict(learning_rate=None, warmup_steps=None, num_steps=None, num_epochs=None)
  return ml_collections.ConfigDict(dict(base, **values))


def test_a_pretrained_model_gets_the_fine_tuning_recipe():
  got = recipe.resolve(train_cfg(), init_from="MODEL", steps_per_epoch=62.5)
  assert got.recipe is recipe.FINETUNE and got.values["learning_rate"] == 2e-5
  assert got.values["num_steps"] == 188 and got.epochs == 3.0  # ceil(3 * 62.5)
  assert got.values["warmup_steps"] == round(0.03 * 188) == 6 and got.warning is None
  assert "fine-tuning (model.init_from)" in got.line and "3.00 epochs" in got.line


def test_from_scratch_gets_the_configs_own_recipe():
  got = recipe.resolve(train_cfg(), init_from=None, steps_per_epoch=429)
  assert got.recipe is recipe.SCRATCH and got.values["learning_rate"] == 1e-3
  assert got.values["num_steps"] == 858


def test_values_the_user_sets_are_kept_and_a_scratch_rate_is_warned_about():
  got = recipe.resolve(train_cfg(learning_rate=1e-3, num_steps=50, warmup_steps=5),
                       init_from="MODEL", steps_per_epoch=10)
  assert got.values == {"learning_rate": 1e-3, "num_steps": 50, "warmup_steps": 5}
  assert got.epochs == 5.0 and "learning_rate" in got.line and "num_steps" in got.line
  assert got.warning is not None and "from-scratch rate" in got.warning
  assert "\n" not in got.warning
  # A fine-tuning rate draws no warning; from scratch never warns.
  assert recipe.resolve(train_cfg(learning_rate=5e-5), init_from="M",
                        steps_per_epoch=10).warning is None
  assert recipe.resolve(train_cfg(learning_rate=1e-2), init_from=None,
                        steps_per_epoch=10).warning is None


def test_epochs_replace_the_configs_steps():
  got = recipe.resolve(train_cfg(num_steps=300, num_epochs=1.5), init_from=None,
                       steps_per_epoch=7)
  assert got.values["num_steps"] == 11 and got.epochs == 1.5  # ceil(10.5)
  cfg = train_cfg(num_steps=300, num_epochs=1.5)
  cfg.lock()
  got.apply(cfg)
  assert cfg.num_steps == 11 and cfg.learning_rate == 1e-3


@pytest.mark.parametrize("key, value", [("num_epochs", -1.0), ("num_epochs", 0.0),
                                        ("num_steps", 0)])
def test_non_positive_values_are_refused_by_name(key, value):
  with pytest.raises(ArgumentError, match=rf"train\.{key} \(--config\.train\.{key}\) must be a "
                                          rf"positive number, got {value!r}"):
    recipe.resolve(train_cfg(**{key: value}), init_from=None, steps_per_epoch=10)


def test_adapters_get_the_lora_rate_and_a_full_fine_tuning_rate_is_not_warned_about():
  got = recipe.resolve(train_cfg(), init_from="MODEL", steps_per_epoch=62.5, adapters=True)
  assert got.values["learning_rate"] == 2e-4 and got.recipe is recipe.ADAPTERS
  assert "LoRA fine-tuning" in got.line
  # 1e-3 warns for full fine-tuning but not for adapters; 1e-2 warns for both.
  assert recipe.resolve(train_cfg(learning_rate=1e-3), init_from="M", steps_per_epoch=10,
                        adapters=True).warning is None
  warned = recipe.resolve(train_cfg(learning_rate=1e-2), init_from="M", steps_per_epoch=10,
                          adapters=True).warning
  assert warned is not None and "LoRA fine-tuning uses about 0.0002" in warned
  # Adapters without a pretrained base are refused elsewhere; here the scratch recipe applies.
  assert recipe.resolve(train_cfg(), init_from=None, steps_per_epoch=10,
                        adapters=True).recipe is recipe.SCRATCH


def test_a_resume_with_another_length_keeps_the_warmup_the_recipe_chose():
  first = recipe.resolve(train_cfg(num_steps=100), init_from="M", steps_per_epoch=10)
  started = first.values  # the train group as run.json records it
  longer = recipe.resolve(train_cfg(num_steps=400), init_from="M", steps_per_epoch=10,
                          started=started)
  assert first.values["warmup_steps"] == 3 and longer.values["warmup_steps"] == 3
  assert recipe.resolve(train_cfg(num_steps=400), init_from="M",  # negative control: 3% of 400
                        steps_per_epoch=10).values["warmup_steps"] == 12
  assert longer.line.endswith("; resumed with 400 steps, the run started with 100: the decay now "
                              "ends at step 400, warmup 3 steps as it started"), longer.line
  same = recipe.resolve(train_cfg(num_steps=100), init_from="M", steps_per_epoch=10,
                        started=started)
  assert same.values == first.values and same.line == first.line
  mine = recipe.resolve(train_cfg(num_steps=400, warmup_steps=7), init_from="M",
                        steps_per_epoch=10, started=started)
  assert mine.values["warmup_steps"] == 7  # a warmup the user sets is theirs


def test_an_sft_style_run_resumes_with_another_num_steps(tmp_path, capsys):
  """A run whose warmup the recipe derives (train.warmup_steps unset, as in configs/sft.py and
  configs/dpo.py: 5% of the steps from scratch), run for 4 steps (warmup 1) and again with 30
  (5%: 2): it resumes at step 4 and trains to 30; a warmup re-derived from the new length made
  the checkpoint's config differ, and the resume was refused naming train.warmup_steps."""
  from support.train_configs import synthetic_config  # pylint: disable=import-outside-toplevel
  from train import train as train_lib  # pylint: disable=import-outside-toplevel

  def config(steps):
    return synthetic_config(**{"train.num_steps": steps, "train.warmup_steps": None,
                               "train.learning_rate": None, "train.checkpoint_every": 2,
                               "train.eval_every": 0, "attention.self_check": False})

  workdir = str(tmp_path / "run")
  assert train_lib.train_and_evaluate(config(4), workdir)["resumed_from"] == 0
  capsys.readouterr()
  resumed = train_lib.train_and_evaluate(config(30), workdir)
  assert resumed["resumed_from"] == 4 and resumed["steps"] == 30, resumed
  out = capsys.readouterr().out
  assert "warmup 1 steps, 30 steps" in out and "resumed with 30 steps, the run started with 4" in out

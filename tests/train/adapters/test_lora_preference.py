"""Preferences with adapters and one copy of the base: the reference is the base with the
adapters off, scored once before step 1. Oracle: `train.preference.score` of the base model alone (itself
checked against transformers in tests/train/preference); negative control: the policy (base +
a non-zero adapter made by `peft`) starts away from ln 2 (tiny models made here; nothing is
downloaded)."""

import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from configs import dpo  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from support import hf_models  # noqa: E402
from support import preference_fixtures  # noqa: E402
from train.preference import score as train_score  # noqa: E402
from train import train as train_lib  # noqa: E402
from train.adapters import trainable  # noqa: E402
from train.hf import config as hf_config  # noqa: E402

LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def setup_dirs(tmp_path_factory):
  """A base model, an adapter of it made by peft (B random, not zero), 8 pairs of its tokens."""
  import torch
  import transformers
  root = tmp_path_factory.mktemp("lora_dpo")
  base = hf_models.make_tokenizer(hf_models.make_model(str(root / "base"), "llama"))
  model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
  lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                         init_lora_weights=False)
  peft.get_peft_model(model, lora).save_pretrained(str(root / "adapter"))
  path = preference_fixtures.write_jsonl(root / "pairs.jsonl", preference_fixtures.word_pairs(
      8, prompt=(10, 12), answer=(8, 18), seed=5))
  assert tokenize_cli.main(["--format", "preference", "--input", path, "--tokenizer",
                            f"hf:{base}", "--output", str(root / "pairs")]) == 0
  return root, base


def _config(base, data, **model):
  config = dpo.get_config()
  config.model.init_from = base
  config.data.train = str(data)
  config.data.eval_share = 0.0
  config.packing.seq_len = 64
  config.attention.implementation = "xla"
  config.attention.self_check = False
  t = config.train
  t.batch_size, t.num_steps, t.log_every, t.eval_every, t.checkpoint_every = 8, 1, 1, 0, 0
  t.learning_rate, t.warmup_steps = 1e-3, 0
  for key, value in model.items():
    config.model[key] = value
  hf_config.adopt(config)
  trainable.adopt_adapter(config)
  return config


def _first(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return next(r for r in map(json.loads, f) if r["kind"] == "train")


def test_the_reference_is_the_base_with_the_adapters_off(setup_dirs, tmp_path):
  root, base = setup_dirs
  config = _config(base, root / "pairs", init_adapter=str(root / "adapter"))
  assert config.model.lora.rank == 4 and config.model.lora.targets == "q,v,up"
  train_lib.train_and_evaluate(config, tmp_path / "run")
  stored = np.load(tmp_path / "run" / "reference" / "train.npy")
  assert train_score.main(["--model", base, "--data", str(root / "pairs"), "--output",
                           str(tmp_path / "scores"), "--seq-len", "64"]) == 0
  want = np.load(tmp_path / "scores" / "dataset.npy")
  np.testing.assert_array_equal(stored[:, 2:], want[:, 2:])
  np.testing.assert_allclose(stored[:, :2], want[:, :2], rtol=1e-5)
  # Negative control: the policy is base + adapter, so its first loss is not ln 2.
  assert abs(_first(tmp_path / "run")["loss"] - LN2) > 1e-3


def test_fresh_adapters_start_at_ln2(setup_dirs, tmp_path):
  root, base = setup_dirs
  config = _config(base, root / "pairs")
  config.model.lora.rank = 4
  train_lib.train_and_evaluate(config, tmp_path / "run")
  first = _first(tmp_path / "run")
  assert abs(first["loss"] - LN2) <= 1e-6 and first["reward_margin"] == 0.0

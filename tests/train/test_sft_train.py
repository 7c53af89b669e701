"""The trainer's chat data path: configs/sft.py and `train.data.make_data` in minibatch mode."""

import math

import numpy as np
import pytest

from configs import sft
from segpack import shards
from segpack.data.minibatch_dataset import pack_minibatches
from train import config_checks
from train import data as data_lib
from support import data_configs  # noqa: E402


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
  config = sft.get_config("smoke")
  cache = str(tmp_path_factory.getbasetemp() / "segpack-chat-cache")
  return config, config, cache


def test_sft_config_trains_minibatches_of_conversations(spec):
  base, config, cache = spec
  s = data_configs.data_config(base, **{ "cache_dir": cache})
  assert (s.data.source, s.packing.mode, s.packing.examples_per_batch) == ("builtin_chat", "minibatch", 4)
  data = data_lib.make_data(s, batch_size=config.train.batch_size, process_index=0,
                            process_count=1)
  from segpack.text.chat import corpus as chat_corpus  # pylint: disable=g-import-not-at-top
  train_dir = chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache).train_dir
  n = len(shards.ShardSource(train_dir))
  # One step per minibatch of 4 conversations: the step count of unpacked training.
  assert data.train_rows_in_epoch0 == math.ceil(n / 4) * config.train.batch_size
  batch = data.train[0]
  assert batch["input_ids"].shape == (config.train.batch_size, config.packing.seq_len)
  labels = batch["labels"]
  # Assistant-only loss: the trained targets are a strict subset of the real slots.
  assert 0 < int((labels != -100).sum()) < int((batch["segment_ids"] > 0).sum())
  assert len(data.train) > 10**9  # infinite
  assert "minibatch ffd packing of 4 examples per step" in data.description


def test_token_budget_must_match_the_batch(spec):
  base, config, cache = spec
  s = data_configs.data_config(base, **{ "cache_dir": cache, "examples_per_batch": None,
                           "tokens_per_batch": 256 * 4})
  with pytest.raises(config_checks.ConfigError, match="gives 4 rows .* train.batch_size=8"):
    config_checks.check_minibatch(s)
  s = data_configs.data_config(base, **{ "cache_dir": cache, "examples_per_batch": None,
                           "tokens_per_batch": 256 * 8})
  data = data_lib.make_data(s, batch_size=8, process_index=0, process_count=1)
  assert np.asarray(data.train[3]["input_ids"]).shape == (8, 256)


def test_packed_minibatch_computes_the_padded_loss(spec):
  """The same minibatch, padded (one conversation per row) or packed: the same loss."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from segpack import loss
  from segpack.text.chat import corpus as chat_corpus
  from train.model import config as model_config  # pylint: disable=g-import-not-at-top
  from train.model import decoder as model_lib  # pylint: disable=g-import-not-at-top

  _, _, cache = spec
  train_dir = chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache).train_dir
  cfg = model_config.DecoderConfig(vocab_size=2048, num_layers=1, d_model=32, num_heads=2,
                                num_kv_heads=2, head_dim=16, d_ff=64,
                                attention_implementation="xla")
  model = model_lib.Decoder(cfg, rngs=nnx.Rngs(params=0))
  kw = dict(seq_len=256, examples_per_batch=6, seed=1, num_epochs=1,
            process_index=0, process_count=1)
  padded = pack_minibatches(train_dir, strategy="pad", **kw)
  packed = pack_minibatches(train_dir, strategy="ffd", **kw)

  @nnx.jit  # one program per batch shape (op-by-op dispatch compiled every op per shape)
  def loss_sum(m, b):
    logits = m(b["input_ids"], segment_ids=b["segment_ids"],
               segment_positions=b["segment_positions"])
    return loss.token_loss_sum(loss.token_cross_entropy(logits, b["labels"]), b["labels"])

  for step in (0, 1):
    losses = []
    for ds in (padded, packed):
      b = {k: jnp.asarray(v) for k, v in ds[step].items()}
      losses.append(loss_sum(model, b))
    (sum_pad, n_pad), (sum_packed, n_packed) = losses
    assert packed[step]["input_ids"].shape[0] < padded[step]["input_ids"].shape[0]
    assert float(n_pad) == float(n_packed) > 0
    np.testing.assert_allclose(float(sum_packed), float(sum_pad), rtol=2e-5)


@pytest.mark.slow
def test_sft_bench_padding_and_minibatch_take_the_same_steps(spec, capsys):
  import json  # pylint: disable=g-import-not-at-top

  from train.bench import training as bench  # pylint: disable=g-import-not-at-top

  _, _, cache = spec
  assert bench.main(["sft", "--max-train", "40", "--seq-len", "256", "--examples-per-batch",
                     "8", "--d-model", "32", "--layers", "1", "--cache-dir", cache,
                     "--json"]) == 0
  results = {r["method"]: r for r in json.loads(capsys.readouterr().out)["results"]}
  pad, mini, glob = results["padding"], results["minibatch"], results["global"]
  assert pad["steps"] == mini["steps"] == 5  # ceil(40 / 8), as unpacked training
  # Global packing: steps follow its rows (here long conversations split into many rows).
  assert glob["padded_slot_fraction"] < mini["padded_slot_fraction"]
  assert pad["trained_tokens"] == mini["trained_tokens"] == glob["trained_tokens"]
  assert mini["padded_slot_fraction"] < pad["padded_slot_fraction"]
  # Same examples per step and the same math: the same model after the epoch.
  np.testing.assert_allclose(mini["heldout_loss"], pad["heldout_loss"], rtol=1e-3)

"""The trainer's chat data path: configs/sft.py and `train.data.make_data` in minibatch mode."""

import math

import numpy as np
import pytest

from configs import sft
from segpack import shards
from train import data as data_lib


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
  config = sft.get_config("smoke")
  cache = str(tmp_path_factory.getbasetemp() / "segpack-chat-cache")
  return data_lib.DataSpec.from_config(config), config, cache


def test_sft_config_trains_minibatches_of_conversations(spec):
  base, config, cache = spec
  s = data_lib.DataSpec(**{**base.__dict__, "cache_dir": cache})
  assert s.source == "builtin_chat" and s.mode == "minibatch" and s.examples_per_batch == 4
  data = data_lib.make_data(s, batch_size=config.train.batch_size, process_index=0,
                            process_count=1)
  from segpack import chat_corpus  # pylint: disable=g-import-not-at-top
  train_dir = chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache).train_dir
  n = len(shards.ShardSource(train_dir))
  # One step per minibatch of 4 conversations: the step count of unpacked training.
  assert data.train_rows_per_epoch == math.ceil(n / 4) * config.train.batch_size
  batch = data.train[0]
  assert batch["input_ids"].shape == (config.train.batch_size, config.packing.seq_len)
  labels = batch["labels"]
  # Assistant-only loss: the trained targets are a strict subset of the real slots.
  assert 0 < int((labels != -100).sum()) < int((batch["segment_ids"] > 0).sum())
  assert len(data.train) > 10**9  # infinite
  assert "minibatch ffd packing of 4 examples per step" in data.description


def test_token_budget_must_match_the_batch(spec):
  base, config, cache = spec
  s = data_lib.DataSpec(**{**base.__dict__, "cache_dir": cache, "examples_per_batch": None,
                           "tokens_per_batch": 256 * 4})
  with pytest.raises(data_lib.DataConfigError, match="gives 4 rows .* train.batch_size=8"):
    data_lib.make_data(s, batch_size=8, process_index=0, process_count=1)
  s = data_lib.DataSpec(**{**base.__dict__, "cache_dir": cache, "examples_per_batch": None,
                           "tokens_per_batch": 256 * 8})
  data = data_lib.make_data(s, batch_size=8, process_index=0, process_count=1)
  assert np.asarray(data.train[3]["input_ids"]).shape == (8, 256)

"""What the trainer's data refuses, in its own keys: a tokenizer without a BOS token when
data.add_bos is on names --config.data.add_bos=False (not the library's SpecialTokens)."""

import pytest

pytest.importorskip("transformers")

from configs import packed  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from support import chat_fixtures  # noqa: E402
from support import hf_models  # noqa: E402
from train import data_sources as data_sources  # noqa: E402
from train import data as data_lib  # noqa: E402


def test_a_tokenizer_without_bos_names_the_config_key(tmp_path):
  tokenizer = chat_fixtures.make_tokenizer(tmp_path / "tok", "qwen2_5")  # Qwen has no BOS
  docs = hf_models.write_text_jsonl(str(tmp_path / "docs.jsonl"), 20)
  assert tokenize_cli.main(["--input", docs, "--tokenizer", f"hf:{tokenizer}", "--output",
                            str(tmp_path / "data")]) == 0
  config = packed.get_config("smoke")
  config.data.train = str(tmp_path / "data")
  with pytest.raises(data_sources.DataConfigError, match=r"has no BOS token.*--config.data.add_bos="
                                                     r"False"):
    data_lib.make_data(config, batch_size=8, process_index=0, process_count=1)
  config.data.add_bos = False
  data = data_lib.make_data(config, batch_size=8, process_index=0, process_count=1)
  assert data.train_rows_in_epoch0 > 0


def test_a_minibatch_larger_than_a_step_names_train_batch_size(tmp_path):
  """The first minibatch is planned as the dataset is made: its refusal names the trainer's key
  (it named the library's `rows_per_batch`); a step of enough rows trains."""
  tokenizer = hf_models.make_tokenizer(str(tmp_path / "tok"))
  docs = hf_models.write_text_jsonl(str(tmp_path / "docs.jsonl"), 40, seed=3)
  assert tokenize_cli.main(["--input", docs, "--tokenizer", f"hf:{tokenizer}", "--output",
                            str(tmp_path / "data")]) == 0
  config = packed.get_config("smoke")
  config.data.train = str(tmp_path / "data")
  config.packing.mode, config.packing.examples_per_batch = "minibatch", 24
  config.packing.seq_len = 64
  with pytest.raises(data_sources.DataConfigError, match=r"but train.batch_size=2 rows make a step; "
                                                     r"raise --config.train.batch_size to \d+"):
    data_lib.make_data(config, batch_size=2, process_index=0, process_count=1)
  assert data_lib.make_data(config, batch_size=64, process_index=0,
                            process_count=1).train_rows_in_epoch0 > 0

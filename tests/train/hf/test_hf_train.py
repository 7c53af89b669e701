"""Fine-tuning an imported Hugging Face model: the first step's loss equals transformers' on the
same documents, and the dataset's tokenizer must be the model's (a tiny model and tokenizer made
here with transformers; nothing is downloaded). The README's fine-tuning commands run end to end
in tests/docs/test_fine_tune_blocks.py."""

import json

import grain
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from support import hf_models  # noqa: E402
from configs import packed  # noqa: E402
from train import data as data_lib  # noqa: E402
from train.hf import config as hf_config  # noqa: E402
from train import train as train_lib  # noqa: E402
from support.train_configs import run_cli
from support import paths

REPO = paths.REPO


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("hf") / "tiny-llama")
  hf_models.make_model(d, "llama", kv_heads=2)
  return hf_models.make_tokenizer(d)


@pytest.fixture(scope="module")
def text_data(model_dir, tmp_path_factory):
  root = tmp_path_factory.mktemp("text")
  hf_models.write_text_jsonl(str(root / "docs.jsonl"), 60, seed=4)
  run_cli("segpack", "tokenize", "--input", str(root / "docs.jsonl"), "--tokenizer",
          f"hf:{model_dir}", "--output", str(root / "data"))
  return root


def _config(model_dir, data_dir, **train):
  config = packed.get_config()
  config.model.init_from = model_dir
  config.data.train = str(data_dir)
  config.packing.seq_len = 256
  config.attention.implementation = "xla"
  config.attention.self_check = False
  t = config.train
  t.batch_size, t.num_steps, t.log_every, t.eval_every, t.checkpoint_every = 8, 1, 1, 0, 0
  for key, value in train.items():
    t[key] = value
  hf_config.adopt(config)
  return config


def test_first_step_loss_equals_transformers_mean_token_loss(model_dir, text_data, tmp_path):
  import transformers
  config = _config(model_dir, text_data / "data")
  assert config.model.vocab_size == 160 and config.model.family == "llama"
  train_lib.train_and_evaluate(config, tmp_path / "run")
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  loss = next(r["loss"] for r in records if r["kind"] == "train" and r["step"] == 1)
  # The same first batch, rebuilt; the trainer logged its fingerprint.
  data = data_lib.make_data(config, batch_size=8,
                            process_index=0, process_count=1)
  batch = next(data.train_iterator(read_options=grain.ReadOptions(num_threads=1)))
  logged = json.loads(open(tmp_path / "run" / "batches.jsonl").readline())
  assert data_lib.fingerprint(batch)[0] == logged["fingerprint"]
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  texts = [json.loads(line)["text"] for line in open(text_data / "docs.jsonl")]
  known = {tuple([tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"]
                 + [tok.eos_token_id]) for t in texts}
  docs = []
  for r in range(len(batch["input_ids"])):
    for s in np.unique(batch["segment_ids"][r][batch["segment_ids"][r] > 0]):
      ids = batch["input_ids"][r][batch["segment_ids"][r] == s]
      assert tuple(ids.tolist()) in known  # a whole document, BOS and EOS as the model has them
      docs.append(ids)
  assert len(docs) >= 3
  want = hf_models.transformers_token_losses(model_dir, docs).mean()
  assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
  # Negative control: a freshly initialised model (std 0.02) predicts nearly uniformly, ln(160);
  # the imported weights (std 0.2) are far from that, so an ignored init_from cannot pass.
  assert abs(want - np.log(160)) > 0.5


# A second mistake that the data's plan would report first if the data were opened before its
# tokenizer is checked: minibatches that need more rows than a step has.
@pytest.mark.parametrize("also", [(), ("--config.packing.mode=minibatch",
                                       "--config.packing.examples_per_batch=64",
                                       "--config.train.batch_size=1")],
                         ids=["alone", "with-too-few-rows-per-step"])
def test_a_dataset_of_another_tokenizer_is_refused(model_dir, text_data, tmp_path, also):
  other = str(tmp_path / "other")
  hf_models.make_tokenizer(other, eos="<unk>")  # the same vocabulary, another EOS
  run_cli("segpack", "tokenize", "--input", str(text_data / "docs.jsonl"), "--tokenizer",
          f"hf:{other}", "--output", str(tmp_path / "data"))
  out = run_cli("train.main", "--config=configs/packed.py:smoke",
                f"--config.model.init_from={model_dir}", f"--config.data.train={tmp_path / 'data'}",
                f"--workdir={tmp_path / 'run'}", *also, check=False)
  assert out.returncode == 2, out.stderr[-2000:]
  line = out.stderr.strip().splitlines()[-1]
  assert "was tokenized with tokenizer sha256:" in line and model_dir in line
  assert len(out.stderr.strip().splitlines()) == 1


def test_builtin_corpus_with_init_from_is_refused(model_dir, tmp_path):
  config = packed.get_config("smoke")
  config.model.init_from = model_dir
  hf_config.adopt(config)
  with pytest.raises(hf_config.HfModelError, match="needs data tokenized with the model's"):
    train_lib.train_and_evaluate(config, tmp_path / "run")


def test_a_contradicting_override_names_both_values(model_dir, tmp_path):
  out = run_cli("train.main", "--config=configs/packed.py:smoke",
                f"--config.model.init_from={model_dir}", "--config.model.d_model=128",
                f"--workdir={tmp_path / 'run'}", check=False)
  assert out.returncode == 2
  line = out.stderr.strip()
  assert "--config.model.d_model=128 contradicts" in line and "says 64" in line
  assert len(line.splitlines()) == 1


def test_sampling_an_imported_run_whose_embedding_outgrows_its_tokenizer(model_dir, text_data,
                                                                        tmp_path, capsys):
  """160 embedding rows, 158 tokenizer ids: train.sample decodes with the dataset's copy of the
  model's tokenizer (it refused such a run as "not the run's tokenizer")."""
  from train.sample import command as sample_lib
  config = _config(model_dir, text_data / "data")
  train_lib.train_and_evaluate(config, tmp_path / "run")
  answers = sample_lib.sample(str(tmp_path / "run"), prompts=["w1 w2 w3"], max_new_tokens=4,
                              num_samples=1)
  assert len(answers) == 1 and answers[0].text.startswith("w1 w2 w3")

"""Fine-tuning an imported Hugging Face model: the first step's loss equals transformers' on the
same documents, the dataset's tokenizer must be the model's, and the README's commands run end
to end (a tiny model and tokenizer made here with transformers; nothing is downloaded)."""

import json
import re
import os
import pathlib
import subprocess
import sys

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
from support import readme

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


def test_a_dataset_of_another_tokenizer_is_refused(model_dir, text_data, tmp_path):
  other = str(tmp_path / "other")
  hf_models.make_tokenizer(other, eos="<unk>")  # the same vocabulary, another EOS
  run_cli("segpack", "tokenize", "--input", str(text_data / "docs.jsonl"), "--tokenizer",
          f"hf:{other}", "--output", str(tmp_path / "data"))
  out = run_cli("train.main", "--config=configs/packed.py:smoke",
                f"--config.model.init_from={model_dir}", f"--config.data.train={tmp_path / 'data'}",
                f"--workdir={tmp_path / 'run'}", check=False)
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


def test_readme_fine_tune_commands(model_dir, tmp_path):
  """The README's "Fine-tune a Hugging Face model" block, with fewer steps."""
  commands = readme.commands("## Fine-tune a Hugging Face model")
  assert commands[0].startswith("python -m segpack tokenize") and "hf:" in commands[0]
  assert commands[1].startswith("python -m train.main --config=configs/sft.py")
  assert commands[2].startswith("python -m train.sample") and "--chat" in commands[2]
  hf_models.write_chat_jsonl(str(tmp_path / "chat.jsonl"), 80, seed=1)
  subs = {"MODEL_DIR": model_dir, "chat.jsonl": str(tmp_path / "chat.jsonl"),
          "data/chat": str(tmp_path / "data" / "chat"), "runs/sft_hf": str(tmp_path / "run"),
          "exported": str(tmp_path / "exported")}
  fewer = [
      "--config.train.num_steps=3", "--config.train.eval_every=3",
      "--config.train.batch_size=8",  # 10 does not divide over the tests' 8 devices
      "--config.train.checkpoint_every=3", "--config.attention.self_check=False"]
  for args, out in readme.run(commands, subs, train_args=fewer):
    if args[0] == "train.main":
      # The fine-tuning recipe (train/recipe.py): TRL's rate, the steps as epochs, printed.
      assert re.search(r"recipe: fine-tuning \(model\.init_from\): learning rate 2e-05, "
                       r"warmup \d+ steps, 3 steps = \d+\.\d\d epochs of [\d.]+ steps", out.stdout)
      assert "from-scratch rate" not in out.stderr
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  summary = records[-1]
  assert summary["kind"] == "summary" and summary["steps"] == 3
  assert np.isfinite(summary["final_loss"])
  # What the export wrote loads in transformers, with the chat template the data was rendered
  # with, and its tokenizer encodes a conversation with the model's own ids.
  import transformers
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "exported"), output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
  ids = tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], tokenize=True,
                                add_generation_prompt=True)
  ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
  assert ids[0] == tok.bos_token_id and "<|assistant|>" in tok.decode(ids)


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


# A template of the model's own, unlike segpack's (BOS from the template, no newlines, the
# end-of-turn token after every message): what a pretrained chat model brings.
OWN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }} "
                "{{ m['content'] }} <|end|> {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")


@pytest.mark.slow
def test_a_chat_model_with_its_own_template_fine_tunes_samples_and_exports(tmp_path):
  """A new user's walk with a chat model: tokenize with its template, fine-tune, `train.sample
  --chat`, export. Oracles: the prompt is transformers' `apply_chat_template(...,
  add_generation_prompt=True)` of the source tokenizer, and the answer `train.sample` prints is
  transformers' greedy `generate` on the exported model, cut at the end of turn."""
  import torch
  import transformers
  model = str(tmp_path / "chat-model")
  hf_models.make_model(model, "llama", kv_heads=2)
  hf_models.make_tokenizer(model)
  tok = transformers.AutoTokenizer.from_pretrained(model)
  tok.chat_template = OWN_TEMPLATE
  tok.save_pretrained(model)
  hf_models.write_chat_jsonl(str(tmp_path / "chat.jsonl"), 60, seed=2)
  run_cli("segpack", "tokenize", "--input", str(tmp_path / "chat.jsonl"), "--tokenizer",
          f"hf:{model}", "--output", str(tmp_path / "data"))
  manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
  assert manifest["metadata"]["chat"]["renderer"] == "hf"
  run_cli("train.main", "--config=configs/sft.py", f"--config.model.init_from={model}",
          f"--config.data.train={tmp_path / 'data'}", f"--workdir={tmp_path / 'run'}",
          "--config.train.num_steps=2", "--config.train.eval_every=0",
          "--config.train.batch_size=8", "--config.train.checkpoint_every=2",
          "--config.attention.self_check=False")
  question = "w5 w6 w7"
  out = run_cli("train.sample", f"--workdir={tmp_path / 'run'}", "--chat",
                f"--prompt={question}", "--max_new_tokens=12")
  printed = out.stdout.splitlines()[1:]
  run_cli("train.hf.export", "--workdir", str(tmp_path / "run"), "--output", str(tmp_path / "out"))
  exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
  prompt = exported.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
  prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
  source = tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True)
  assert prompt == list(source["input_ids"] if hasattr(source, "keys") else source)
  lm = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                         dtype=torch.float32)
  stops = [exported.eos_token_id, exported.convert_tokens_to_ids("<|end|>")]
  # The export's generation_config.json stops at the template's end of turn: `generate` is
  # given no stop ids of its own.
  generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
  assert set(stops) <= set(generation.eos_token_id), (stops, generation.eos_token_id)
  with torch.no_grad():
    new = lm.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                      pad_token_id=0, top_k=None, top_p=None,
                      temperature=None)[0, len(prompt):].tolist()
  if new and new[-1] in stops:
    new = new[:-1]
  assert len(new) >= 3 and printed == exported.decode(new).splitlines(), (new, printed)

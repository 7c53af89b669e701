"""Training on the user's own data: `--config.data.train=PATH` (and `data.eval`, or a held-out
share chosen by document id).

Oracles: documents whose every token names the document (token BASE + d), so a row's tokens say
which documents it holds without the pipeline; a plain list of the same documents packed by
`pack_dataset`; and, end to end, the README's two commands run as a new user runs them.
"""

import json
import os
import pathlib
import sysconfig

import numpy as np
import pytest

import segpack
from segpack import shards
from segpack.data import subset
from segpack.text import dataset as dataset_lib
from train import config_checks
from train import data_sources as data_sources
from train import data as data_lib
from support import data_configs  # noqa: E402
from support import paths

REPO = paths.REPO
BASE, BOS, EOS = 16, 1, 2


def write_named_docs(path, num_docs):
  """Document d: tokens BASE + d, repeated 1..40 times; BOS/EOS ids in the manifest."""
  lengths = np.random.default_rng(0).integers(1, 41, size=num_docs)
  with shards.ShardWriter(str(path), vocab_size=BASE + num_docs, tokenizer_fingerprint="named",
                          shard_tokens=500,
                          metadata={"tokenizer": {"bos_id": BOS, "eos_id": EOS, "pad_id": 0}}) as w:
    for d, n in enumerate(lengths):
      w.write(np.full(int(n), BASE + d, dtype=np.int32))
  return lengths


def spec(**kw):
  return data_configs.builtin_data_config(**{"seq_len": 64, **kw})


def docs_in(batches):
  """The documents whose tokens appear in the batches' real slots."""
  found = set()
  for batch in batches:
    ids = batch["input_ids"][batch["segment_ids"] > 0]
    found |= set((ids[ids >= BASE] - BASE).tolist())
  return found


def test_held_out_documents_never_reach_a_training_row(tmp_path):
  lengths = write_named_docs(tmp_path / "ds", 400)
  data = data_lib.make_data(spec(train=str(tmp_path / "ds"), eval_share=0.1), batch_size=8,
                            process_index=0, process_count=1)
  epoch = -(-data.train_rows_in_epoch0 // 8)
  trained = docs_in(data.train[k] for k in range(2 * epoch))  # two epochs
  held = docs_in(data.eval[k] for k in range(len(data.eval)))
  want_held = set(np.flatnonzero(subset.held_out_mask(400, share=0.1)).tolist())
  assert held == want_held and 20 < len(held) < 60  # about 10%
  assert not trained & held
  assert trained | held == set(range(400))
  assert data.vocab_size == BASE + 400 and lengths.sum() > 0
  # The split depends on the document index only: the same on two processes, with another seed.
  two = [data_lib.make_data(spec(train=str(tmp_path / "ds"), eval_share=0.1, seed=5),
                            batch_size=8, process_index=p, process_count=2) for p in range(2)]
  assert docs_in(d.eval[k] for d in two for k in range(len(d.eval))) == want_held
  assert not docs_in(d.train[k] for d in two for k in range(2 * epoch)) & want_held


def test_held_out_mask_is_a_property_of_each_document():
  big = subset.held_out_mask(100_000, share=0.05)
  assert abs(big.mean() - 0.05) < 0.005
  assert np.array_equal(subset.held_out_mask(1_000, share=0.05), big[:1_000])  # per document
  assert not np.array_equal(subset.held_out_mask(1_000, share=0.05, salt=1), big[:1_000])
  with pytest.raises(segpack.PipelineConfigError, match="share must be a number in"):
    subset.held_out_mask(10, share=1.0)


def test_a_subset_packs_like_a_list_of_its_documents(tmp_path):
  write_named_docs(tmp_path / "ds", 120)
  train, held = subset.held_out_split(str(tmp_path / "ds"), share=0.2)
  source = shards.ShardSource(str(tmp_path / "ds"))
  for part in (train, held):
    plain = [np.asarray(source[int(i)]) for i in part.parent_ids]
    got = segpack.pack_dataset(part, seq_len=32, num_epochs=1, shuffle=False)
    want = segpack.pack_dataset(plain, seq_len=32, num_epochs=1, shuffle=False,
                                special_tokens=segpack.SpecialTokens(bos_id=BOS, eos_id=EOS))
    a, b = got.get_batch(np.arange(len(got))), want.get_batch(np.arange(len(want)))
    assert all(np.array_equal(a[k], b[k]) for k in a)
  assert train.fingerprint != held.fingerprint  # one cached plan each, beside the shards


def _write_lengths(path, lengths):
  """Document d: `lengths[d]` tokens BASE + d."""
  with shards.ShardWriter(str(path), vocab_size=BASE + len(lengths), tokenizer_fingerprint="named",
                          metadata={"tokenizer": {"bos_id": BOS, "eos_id": EOS, "pad_id": 0}}) as w:
    for d, n in enumerate(lengths):
      w.write(np.full(int(n), BASE + d, dtype=np.int32))


def test_a_held_out_share_of_the_tokens_far_from_eval_share_is_a_warning(tmp_path, caplog):
  """Documents of one length: the held-out documents' token share is theirs, said in the data
  line, no warning. Then the same split (by document index) with the held-out documents long and
  the others short: a warning naming the documents and the tokens' share (counted here from the
  held-out rows)."""
  _write_lengths(tmp_path / "even", [20] * 60)
  with caplog.at_level("WARNING", logger="train.data"):
    data = data_lib.make_data(spec(train=str(tmp_path / "even"), eval_share=0.1), batch_size=8,
                              process_index=0, process_count=1)
  assert not [r for r in caplog.records if "eval_share" in r.getMessage()]
  held = sorted(docs_in(data.eval[k] for k in range(len(data.eval))))
  assert 0 < len(held) < 60
  assert data.description.endswith(f"; held out: {len(held)} of 60 documents, "
                                   f"{len(held) / 60:.1%} of the tokens")
  lengths = [60 if d in held else 2 for d in range(60)]
  _write_lengths(tmp_path / "lopsided", lengths)
  caplog.clear()
  with caplog.at_level("WARNING", logger="train.data"):
    data = data_lib.make_data(spec(train=str(tmp_path / "lopsided"), eval_share=0.1),
                              batch_size=8, process_index=0, process_count=1)
  assert sorted(docs_in(data.eval[k] for k in range(len(data.eval)))) == held
  fraction = 60 * len(held) / sum(lengths)
  (message,) = [r.getMessage() for r in caplog.records if "eval_share" in r.getMessage()]
  assert (f"data.eval_share=0.1 held out {len(held)} of the 60 documents of data.train, "
          f"{100 * fraction:.1f}% of its tokens") in message and "data.eval=DIR" in message
  assert data.description.endswith(f"{fraction:.1%} of the tokens")


def test_eval_share_zero_trains_on_every_document_without_evaluation(tmp_path):
  write_named_docs(tmp_path / "ds", 50)
  data = data_lib.make_data(spec(train=str(tmp_path / "ds"), eval_share=0.0), batch_size=8,
                            process_index=0, process_count=1)
  epoch = -(-data.train_rows_in_epoch0 // 8)
  assert data.eval is None and "evaluation is off" in data.description
  assert docs_in(data.train[k] for k in range(epoch)) == set(range(50))


def test_bad_data_keys_are_one_line_errors_naming_the_key(tmp_path):
  write_named_docs(tmp_path / "ds", 50)
  with open(tmp_path / "other.txt", "w") as f:
    f.write("x")
  cases = [
      (dict(train=str(tmp_path / "nope")), "data.train=.*nope.* could not be opened as a dataset.*does not exist"),
      (dict(train=str(tmp_path / "ds"), eval_share=0.99), "data.eval_share=0.99"),
  ]
  for kw, match in cases:
    with pytest.raises(data_sources.DataConfigError, match=match):
      data_lib.make_data(spec(**kw), batch_size=8, process_index=0, process_count=1)
  # Rules between keys are checked once, before anything is built (train.config_checks).
  combinations = [
      (dict(train=str(tmp_path / "ds"), source="synthetic"), "data.source='synthetic'"),
      (dict(eval=str(tmp_path / "ds")), "data.eval=.* is for data.train"),
  ]
  for kw, match in combinations:
    with pytest.raises(config_checks.ConfigError, match=match):
      config_checks.check_data(spec(**kw))
  config_checks.check_data(spec(train=str(tmp_path / "ds"), eval=str(tmp_path / "ds")))


def _stdlib_jsonl(path, *, count, chat=False):
  """Real text every Python has: standard-library sources, as JSONL (or as conversations)."""
  files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:count]
  with open(path, "w") as f:
    for file in files:
      text = file.read_text(errors="replace")[:3000]
      if chat:
        record = {"messages": [{"role": "user", "content": f"Show me {file.name}."},
                               {"role": "assistant", "content": text}]}
      else:
        record = {"text": text}
      f.write(json.dumps(record) + "\n")


@pytest.mark.slow
def test_readme_train_on_your_own_text(tmp_path):
  """The README's "Train on your own text" block as written, from a new user's directory, on a
  docs.jsonl of standard-library sources, with 2 steps. (Chat data through the same two
  commands: docs/sft.md's "Shards carry the mask" block, tests/docs/test_fine_tune_blocks.py, and
  test_chat_dataset_trains_only_the_masked_tokens below.)"""
  from support import doc_blocks
  _stdlib_jsonl(tmp_path / "docs.jsonl", count=120)
  os.symlink(REPO / "configs", tmp_path / "configs")
  commands = doc_blocks.commands("# segpack", index=2)
  assert commands[0] == "python -m segpack tokenize --input docs.jsonl --vocab-size 8000 --output data/mine"
  assert commands[1] == "python -m train.main --config=configs/packed.py --config.data.train=data/mine"
  for args, out in doc_blocks.run(commands, {}, train_args=["--config.train.num_steps=2"],
                                  cwd=tmp_path):
    if args[0] == "train.main":
      assert str(tmp_path / "data" / "mine") in out.stdout  # the data line names the dataset
      workdir = out.stdout.split("workdir=")[-1].split()[0]
  assert pathlib.Path(workdir).parent == tmp_path / "runs"
  with open(pathlib.Path(workdir) / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  losses = [r["loss"] for r in records if r.get("kind", "train") == "train" and "loss" in r]
  assert losses and all(np.isfinite(losses))
  source = shards.ShardSource(str(tmp_path / "data" / "mine"))
  assert abs(losses[0] - np.log(source.vocab_size)) < 0.5  # the model's vocabulary is the manifest's
  assert any("eval_loss" in r for r in records)
  assert not source.has_loss_mask


def test_chat_dataset_trains_only_the_masked_tokens(tmp_path):
  """A chat dataset's loss mask reaches the trainer's rows with nothing asked: the trained
  labels of an epoch are exactly those of `pack_dataset(loss_mask=True)` on the same split."""
  _stdlib_jsonl(tmp_path / "chat.jsonl", count=40, chat=True)
  dataset_lib.tokenize_files([str(tmp_path / "chat.jsonl")], str(tmp_path / "ds"),
                             vocab_size=400, input_format="chat", workers=1)
  data = data_lib.make_data(spec(train=str(tmp_path / "ds"), seq_len=256), batch_size=1,
                            process_index=0, process_count=1)
  trained = sum(int((data.train[k]["labels"] != -100).sum())  # exactly one epoch
                for k in range(data.train_rows_in_epoch0))
  train_part, _ = subset.held_out_split(str(tmp_path / "ds"), share=0.02)
  counts = {}
  for mask in (True, False):
    ds = segpack.pack_dataset(train_part, seq_len=256, num_epochs=1, loss_mask=mask)
    counts[mask] = int((ds.get_batch(np.arange(len(ds)))["labels"] != -100).sum())
  assert trained == counts[True] < counts[False]

"""The README's main job, its training block and its "Use" blocks, run as written from a new
user's directory (the clone's `configs/` linked in, files the blocks name made there), with fewer
steps. One module, so that the full built-in corpus the main job builds is built once.

Oracles: the text each input holds, counted apart from segpack (documents per file); the
per-document attention of support/attention_oracle.py; the rows' own segment rules (ids from 1,
positions from 0 in each document, labels -100 at each document's end).
"""

import gzip
import json
import os

import numpy as np
import pytest

from segpack.shards import ShardSource
from support import chat_fixtures
from support import doc_blocks
from support import paths
from support import small_corpus

FEWER = ["--config.train.num_steps=2"]
# The lines of the training block that a CI machine cannot run, and why. Their config files,
# variants and keys are checked by tests/house/test_docs_commands.py.
_FULL = "a full-length run (300 steps, minutes on a CPU)"
NOT_RUN = {
    "python -m train.main --config=configs/padded.py": _FULL,
    "python -m train.main --config=configs/sft.py": _FULL,
    "python -m train.main --config=configs/packed.py:gpu": "113M parameters at 4096 slots: a GPU",
    "python -m train.main --config=configs/packed.py:long": "8 GPUs",
    "python -m train.main --config=configs/packed.py --config.loss.weighting=sequence": _FULL,
    "python -m train.main --config=configs/packed.py --config.packing.balance=attention": _FULL,
    "python -m train.main --config=configs/packed.py --config.packing.repack=epoch": _FULL,
}


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  """A directory holding `configs/` (linked) and the environment: the tests' shared corpus cache
  (the small corpus is built there; the main job adds the full one)."""
  home = tmp_path_factory.mktemp("user")
  os.symlink(paths.REPO / "configs", home / "configs")
  return home, {"SEGPACK_CACHE": str(small_corpus.cache_dir(tmp_path_factory))}


@pytest.mark.slow
def test_the_main_job_then_the_training_block(user):
  home, env = user
  (first,) = doc_blocks.commands("# segpack")
  assert first == "pip install -e . && python -m train.main --config=configs/packed.py"
  ((args, out),) = doc_blocks.run([first], {}, train_args=FEWER, cwd=home, env=env)
  assert "workdir=" + str(home / "runs" / "packed") in out.stdout, out.stdout[-2000:]
  records = [json.loads(x) for x in (home / "runs" / "packed" / "metrics.jsonl").open()]
  assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 2
  assert np.isfinite(records[-1]["final_eval_loss"])
  lines = doc_blocks.commands("## Use", index=5)
  runnable = [c for c in lines if c not in NOT_RUN]
  assert len(lines) - len(runnable) == len(NOT_RUN)  # each reason names a line of the block
  tensorboard = runnable.pop()
  assert tensorboard == "tensorboard --logdir runs/packed/tensorboard"
  assert [c.split()[2] for c in runnable] == ["train.main", "train.main", "train.plot"]
  done = {}
  for args, out in doc_blocks.run(runnable, {}, train_args=FEWER, cwd=home, env=env):
    done[" ".join(args[:2])] = out
  # The main job again: the finished run is kept, not trained again.
  assert "nothing to do" in done["train.main --config=configs/packed.py"].stdout.lower()
  assert (home / "runs" / "packed_smoke" / "checkpoints").is_dir()
  assert (home / "runs" / "packed" / "curves.png").stat().st_size > 1000
  events = list((home / "runs" / "packed" / "tensorboard").glob("events.out.tfevents.*"))
  assert events and events[0].stat().st_size > 0  # what `tensorboard --logdir` reads


def _inputs(home, tmp_path_factory):
  """The files the ingest block names: docs.jsonl.gz, tok/tokenizer.json, pq/, saved/train."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  texts = small_corpus.train_texts(120)
  with gzip.open(home / "docs.jsonl.gz", "wt") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts[:80])
  chat_fixtures.make_tokenizer(home / "tok", "qwen2_5")
  (home / "pq").mkdir()
  pq.write_table(pa.table({"text": texts[80:100]}), home / "pq" / "part-0.parquet")
  pq.write_table(pa.table({"text": texts[100:]}), home / "pq" / "part-1.parquet")
  datasets.Dataset.from_dict({"text": texts[:50]}).save_to_disk(str(home / "saved" / "train"))
  return {"data/mine": 80, "data/hf": 80, "data/pq": 40, "data/saved": 50}


@pytest.mark.slow
def test_the_use_blocks(user, tmp_path_factory):
  """The ingest block (every input kind), then the Python blocks that read its output."""
  home, env = user
  counts = _inputs(home, tmp_path_factory)
  commands = doc_blocks.commands("## Use")
  assert len(commands) == 6 and commands[0].startswith("python -m segpack tokenize --input builtin")
  for args, out in doc_blocks.run(commands, {}, train_args=[], cwd=home, env=env):
    if args[1] == "stats":
      assert "planning time" in out.stdout
  for name, count in counts.items():
    assert len(ShardSource(home / name)) == count, name
  assert len(ShardSource(home / "data" / "builtin" / "train")) > 8000  # the full corpus
  ns = doc_blocks.python_block(doc_blocks.block("README.md", "## Use", 2).text, {}, home)
  batch = ns["batch"]
  assert {k: v.shape for k, v in batch.items()} == {
      k: (8, 4096) for k in ("input_ids", "labels", "segment_ids", "segment_positions")}
  _check_rows(batch)
  ns = doc_blocks.python_block(doc_blocks.block("README.md", "## Use", 3).text, {}, home)
  row = ns["rows"][0]
  assert row["input_ids"].shape == (4096,) and row["segment_ids"].max() <= 64
  assert len(ns["steps"]) > 0


def _check_rows(batch):
  """Segment ids 1, 2, ... then 0 on padding; positions restart at 0 in each document; the label
  of each document's last token is -100."""
  for seg, pos, labels in zip(batch["segment_ids"], batch["segment_positions"], batch["labels"]):
    real = seg > 0
    assert seg[0] == 1 and np.all(np.diff(seg[real]) >= 0) and not np.any(seg[~real])
    starts = np.flatnonzero(np.diff(seg, prepend=0) != 0)
    assert np.all(pos[starts[seg[starts] > 0]] == 0)
    ends = np.flatnonzero(np.diff(seg, append=0) != 0)
    assert np.all(labels[ends[seg[ends] > 0]] == -100)


def test_the_attention_line_of_use(tmp_path):
  """README's segment_attention line, with the q, k, v and segment ids it leaves to the reader:
  equal to per-document attention (support/attention_oracle.py)."""
  from support import attention_inputs
  from support import attention_oracle
  q, k, v, _ = attention_inputs.random_inputs(0, 4, 256, 4, 2, 32)
  seg = attention_inputs.layouts(256)
  ns = {"q_BxSxHxD": q, "k_BxSxKxD": k, "v_BxSxKxD": v, "segment_ids_BxS": seg}
  ns = doc_blocks.python_block(doc_blocks.block("README.md", "## Use", 4).text, ns, tmp_path)
  want, _ = attention_oracle.reference(q, k, v, seg, causal=True)
  np.testing.assert_allclose(np.asarray(ns["out_BxSxHxD"]), want, atol=2e-5)

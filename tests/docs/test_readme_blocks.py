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
# The lines of the training blocks (README's, docs/training.md's, docs/sft.md's) that a CI
# machine cannot run, and why. Their config files, variants and keys are checked by
# tests/house/test_docs_commands.py.
_FULL = "a full-length run (minutes on a CPU)"
_MAIN = "python -m train.main --config="
NOT_RUN = {
    _MAIN + "configs/padded.py": _FULL,
    _MAIN + "configs/sft.py": _FULL,
    _MAIN + "configs/sft.py --config.packing.mode=global": _FULL,
    _MAIN + "configs/packed.py:gpu": "113M parameters at 4096 slots: a GPU",
    _MAIN + "configs/packed.py:long": "8 GPUs",
    _MAIN + "configs/packed.py --config.loss.weighting=sequence": _FULL,
    _MAIN + "configs/packed.py --config.packing.balance=attention": _FULL,
    _MAIN + "configs/packed.py --config.packing.repack=epoch": _FULL,
    _MAIN + "configs/packed.py --config.train.num_steps=1000 --workdir=runs/long": _FULL,
    "python -m train.bench packed '[--json]'": "a benchmark at full size (tests/train/test_train.py "
                                               "runs it small)",
    "python -m train.sample --benchmark": "a benchmark of 90 s (tests/train/sample/"
                                          "test_sample_chat.py runs it small)",
}
# The full chat run docs/training.md samples is made here by docs/sft.md's smoke line.
SUBS = {"runs/sft ": "runs/sft_smoke "}


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  """A directory holding `configs/` (linked) and the environment: the tests' shared corpus cache
  (the small corpus is built there; the main job adds the full one)."""
  home = tmp_path_factory.mktemp("user")
  os.symlink(paths.REPO / "configs", home / "configs")
  return home, {"SEGPACK_CACHE": str(small_corpus.cache_dir(tmp_path_factory))}


_RAN: dict[str, object] = {}


def _run_lines(block, home, env):
  """Runs the lines of `block` not in NOT_RUN, 2 steps each (a line an earlier block ran in this
  directory is not run again); returns {line: process}."""
  runnable = [c for c in block.commands() if c not in NOT_RUN]
  done = {c: _RAN[c] for c in runnable if c in _RAN}
  commands = [c for c in runnable if not c.startswith("tensorboard ") and c not in _RAN]
  for command, (_, out) in zip(commands, doc_blocks.run(commands, SUBS, train_args=FEWER,
                                                         cwd=home, env=env)):
    done[command] = _RAN[command] = out
  return done


@pytest.mark.slow
def test_the_main_job_then_the_training_blocks(user):
  """README's main job, its training block, docs/training.md's and docs/sft.md's training
  blocks, then docs/training.md's sampling block on the runs they made."""
  home, env = user
  (first,) = doc_blocks.commands("# segpack")
  assert first == "pip install -e . && python -m train.main --config=configs/packed.py"
  ((args, out),) = doc_blocks.run([first], {}, train_args=FEWER, cwd=home, env=env)
  _RAN[first.split(" && ")[1]] = out  # the training blocks' first line: run once
  assert "workdir=" + str(home / "runs" / "packed") in out.stdout, out.stdout[-2000:]
  records = [json.loads(x) for x in (home / "runs" / "packed" / "metrics.jsonl").open()]
  assert records[-1]["kind"] == "summary" and records[-1]["steps"] == 2
  assert np.isfinite(records[-1]["final_eval_loss"])
  readme = doc_blocks.block("README.md", "## Use", 5)
  assert readme.commands()[-1] == "tensorboard --logdir runs/packed/tensorboard"
  done = _run_lines(readme, home, env)
  _check_smoke_run(home / "runs" / "packed_smoke")
  _check_plot(home / "runs" / "packed")
  events = list((home / "runs" / "packed" / "tensorboard").glob("events.out.tfevents.*"))
  assert events and events[0].stat().st_size > 0  # what `tensorboard --logdir` reads
  done = _run_lines(doc_blocks.block("docs/training.md", "# Training"), home, env)
  assert len(done) == 4 and (home / "runs" / "synth" / "checkpoints").is_dir()
  done = _run_lines(doc_blocks.block("docs/sft.md", "## Training: `configs/sft.py`"), home, env)
  assert len(done) == 1 and (home / "runs" / "sft_smoke" / "checkpoints").is_dir()
  done = _run_lines(doc_blocks.block("docs/training.md", "## See what it learned"), home, env)
  printed = [out.stdout for out in done.values()]
  assert len(printed) == 4
  header, *text = printed[0].splitlines()
  assert header.startswith("=== prompt 1, sample 1/1 (greedy)") and text[0].startswith("def ")
  assert printed[1].count("=== prompt") == 6 and "top_k=40" in printed[1]
  assert "<|" not in printed[2]  # the chat answer only, no turn markers
  assert printed[3].split("===")[-1].split("\n")[1].startswith("5,6,7 | ")


def _check_smoke_run(workdir):
  """Every metric of the smoke run's steps is finite; evaluation at step 0 and at the end; the
  last step's checkpoint."""
  records = [json.loads(x) for x in (workdir / "metrics.jsonl").open()]
  train = [r for r in records if r.get("kind") == "train"]
  assert [r["step"] for r in train] == [1, 2]
  for key in ("loss", "lr", "grad_norm", "real_tokens_per_s", "slot_utilization", "elapsed_s",
              "eta_s"):
    assert all(np.isfinite(r[key]) for r in train), key
  assert all(0.5 < r["slot_utilization"] <= 1.0 for r in train)
  evals = [r for r in records if r.get("kind") == "eval"]
  assert [r["step"] for r in evals] == [0, 2] and evals[0]["eval_tokens"] > 0
  assert (workdir / "checkpoints" / "2").is_dir()


def _check_plot(workdir):
  """One PNG, drawn (matplotlib is a test dependency), with the umask's mode, no temporary."""
  assert (workdir / "curves.png").stat().st_size > 1000
  umask = os.umask(0)
  os.umask(umask)
  assert (workdir / "curves.png").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
  assert not list(workdir.glob("*.png.tmp*")) and len(list(workdir.glob("*.png"))) == 1


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
  """The ingest block (every input kind) and docs/packing.md's "### Statistics CLI" block, then
  the Python blocks that read their output."""
  home, env = user
  counts = _inputs(home, tmp_path_factory)
  commands = doc_blocks.commands("## Use")
  assert len(commands) == 6 and commands[0].startswith("python -m segpack tokenize --input builtin")
  for args, out in doc_blocks.run(commands, {}, train_args=[], cwd=home, env=env):
    if args[1] == "stats":
      assert "planning time" in out.stdout
  for name, count in counts.items():
    assert len(ShardSource(home / name)) == count, name
  stats = doc_blocks.commands("### Statistics CLI", doc="docs/packing.md")
  outs = [out.stdout for _, out in doc_blocks.run(stats, {"DIR": "data/builtin/train"},
                                                   train_args=[], cwd=home, env=env)]
  assert "planning time" in outs[0] and "sorted_pad" in outs[1]
  assert len(ShardSource(home / "data" / "builtin" / "train")) > 8000  # the full corpus
  ns = doc_blocks.python_block(doc_blocks.block("README.md", "## Use", 2).text, {}, home)
  batch = ns["batch"]
  assert {k: v.shape for k, v in batch.items()} == {
      k: (8, 4096) for k in ("input_ids", "labels", "segment_ids", "segment_positions")}
  _check_rows(batch)
  ns = doc_blocks.python_block(doc_blocks.block("README.md", "## Use", 3).text, {}, home)
  row = ns["rows"][0]
  assert row["input_ids"].shape == (4096,) and row["segment_ids"].max() <= 64
  steps = ns["steps"]
  first = [steps[i]["segment_ids"] for i in range(10)]
  assert all(s.shape == (8, 4096) for s in first)  # tokens_per_batch // seq_len rows a step
  padding = 1 - sum(int((s != 0).sum()) for s in first) / sum(s.size for s in first)
  assert padding < 0.10, padding  # the example packs its steps full (98.7% padding before)


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

"""`train.sample`: the logits it decodes from are the training forward pass's, greedy decoding is
the argmax of those, the checkpoint's parameters are the ones restored, a damaged checkpoint is
skipped (or refused) without touching the workdir, and the command's errors."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from configs import packed
from segpack.cli import main as cli_main
from segpack.shards import staging
from segpack.text.tokenizers import spm
from support.train_configs import synthetic_config
from support import train_configs
from train import checkpoint_digest as digest_lib
from train.model import decoder as model_lib
from train.rollout import cache as cache_lib
from train.rollout import engine
from train.rollout import sampling as sampling_lib
from train.sample import reference
from train.runs import tokenizer as run_tokenizer
from train.sample import prompts as sample_prompts
from train.sample import command as sample_lib
from train.runs import saved as saved_run
from train.runs import loaded as loaded_run
from train.runs.errors import RunError
from train import train as train_lib
from support import paths

REPO = str(paths.REPO)
STEPS = 4


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
  """A workdir with the checkpoints of steps 2 and 4 of a tiny synthetic run (vocabulary 97,
  rows of 64)."""
  workdir = tmp_path_factory.mktemp("synthetic_run")
  config = synthetic_config(**{"train.num_steps": STEPS, "train.checkpoint_every": 2,
                         "train.max_checkpoints": 2, "train.eval_every": 0,
                         "train.log_batches": False, "attention.self_check": False})
  train_lib.train_and_evaluate(config, str(workdir))
  return str(workdir)


@pytest.fixture(scope="module")
def loaded(synthetic_run):
  return loaded_run.load_run(synthetic_run)


@nnx.jit
def _call(model, input_ids, segment_ids, segment_positions):
  return model(input_ids, segment_ids=segment_ids, segment_positions=segment_positions)


def _training_logits(model, tokens):
  """Logits `[n, V]` of the model called as the trainer's loss calls it, on the unpadded row."""
  ids_1xN = jnp.asarray([tokens], jnp.int32)
  logits_1xNxV = _call(model, ids_1xN, jnp.ones_like(ids_1xN),
                       jnp.arange(len(tokens), dtype=jnp.int32)[None])
  return np.asarray(logits_1xNxV[0])


def _run_cli(*args):
  return subprocess.run([sys.executable, "-m", "train.sample", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, XLA_FLAGS=train_configs.one_cpu_device()))


def test_load_run_reads_the_config_step_and_vocabulary(loaded):
  config, model, step = loaded
  assert step == STEPS and config.data.source == "synthetic"
  assert model.cfg.vocab_size == config.data.synthetic_vocab == 97
  assert model.cfg.attention_implementation == "xla"


@pytest.mark.parametrize("length", [1, 5, 16, 17, 40])
def test_reference_logits_equal_the_training_forward_pass(loaded, length):
  """The oracle's padded, jitted logits at the last token equal the unpadded training call's."""
  _, model, _ = loaded
  tokens = [1] + list(np.random.default_rng(length).integers(3, 97, size=length - 1))
  got_V = reference.last_logits(model, tokens)
  np.testing.assert_allclose(np.asarray(got_V), _training_logits(model, tokens)[-1],
                             rtol=1e-5, atol=1e-5)


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [[1] + [int(t) for t in rng.integers(3, 97, size=n - 1)] for n in lengths]


def _flat(tree):
  """`{path: array}` with nnx's `value` leaf keys dropped and indices as strings."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    out[keys[:-1] if keys[-1] == "value" else keys] = np.asarray(leaf)
  return out


def test_restored_parameters_are_the_checkpoints(synthetic_run, loaded):
  config, model, step = loaded
  state_dir = os.path.join(synthetic_run, "checkpoints", str(step), "state")
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(state_dir).item_metadata.tree
  saved = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
      restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))
  want, got = _flat(saved["params"]), _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  assert sorted(want) == sorted(got) and len(got) > 10
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=str(key))
  # The untrained model the run started from gives other logits: a missed restore shows.
  with config.unlocked():
    config.attention.implementation = "xla"
  fresh = model_lib.build(config, config.train.seed, vocab_size=model.cfg.vocab_size)
  tokens = [1, 5, 6, 7]
  assert np.abs(_training_logits(fresh, tokens) - _training_logits(model, tokens)).max() > 1e-3


def test_tokenizer_of_a_tokenized_dataset(tmp_path):
  texts = [f"def f{i}(x, y{i % 7}):\n    return x * {i} + y{i % 7} - {i * 31 % 97}\n"
           for i in range(2000)]
  tok = spm.train_spm(texts, tmp_path / "data" / "spm.model", vocab_size=320)
  (tmp_path / "data" / "manifest.json").write_text(json.dumps(
      {"metadata": {"tokenizer": tok.describe()}}))
  config = packed.get_config("smoke")
  with config.unlocked():
    config.data.train = str(tmp_path / "data")
  got = run_tokenizer.tokenizer_for_run(config)
  assert got.fingerprint == tok.fingerprint and got.vocab_size == 320
  (tmp_path / "data" / "manifest.json").write_text(json.dumps(
      {"metadata": {"tokenizer": {"type": "bpe?", "model_file": "x"}}}))
  with pytest.raises(RunError, match=r"data.train=.* type 'bpe\?'"):
    run_tokenizer.tokenizer_for_run(config)


def _tokenized(tmp_path, name, model):
  (tmp_path / f"{name}.txt").write_text("\n\n".join(f"def g{i}(x):\n    return x + {i}"
                                                    for i in range(50)), encoding="utf-8")
  out = tmp_path / name
  assert cli_main.main(["tokenize", "--input", str(tmp_path / f"{name}.txt"), "--spm-model",
                        str(model), "--output", str(out)]) == 0
  return out


def test_the_tokenizer_of_a_mixture_and_of_a_url_run(tmp_path, monkeypatch):
  """A mixture's sources (their copies of one tokenizer), a URL's staged copy, and a mixture of
  two tokenizers refused by name."""
  texts = [f"def f{i}(x, y{i % 7}):\n    return x * {i} + y{i % 7}\n" for i in range(2000)]
  tok = spm.train_spm(texts, tmp_path / "m1" / "spm.model", vocab_size=300)
  other = spm.train_spm(texts[::-1], tmp_path / "m2" / "spm.model", vocab_size=310)
  a, b = _tokenized(tmp_path, "a", tok.model_file), _tokenized(tmp_path, "b", tok.model_file)
  c = _tokenized(tmp_path, "c", other.model_file)
  config = packed.get_config("smoke")
  with config.unlocked():
    config.data.train = f"x={a}:0.6,y={b}:0.4"
  assert run_tokenizer.tokenizer_for_run(config).fingerprint == tok.fingerprint
  config.data.train = f"x={a},z={c}"
  with pytest.raises(RunError, match="tokenized with different tokenizers"):
    run_tokenizer.tokenizer_for_run(config)
  monkeypatch.setenv("SEGPACK_CACHE", str(tmp_path / "cache"))
  url = "s3://bucket/datasets/c"
  shutil.copytree(c, staging.staged_dir(url=url))  # what the trainer's staging left
  config.data.train = url
  assert run_tokenizer.tokenizer_for_run(config).fingerprint == other.fingerprint
  config.data.train = f"p={url}:1,q={c}:1"
  assert run_tokenizer.dataset_dirs(config) == [str(staging.staged_dir(url=url)), str(c)]


def _listing(root):
  return sorted((path, sorted(files)) for path, _, files in os.walk(root))


def test_cli_prints_ids_of_a_synthetic_run(synthetic_run):
  before = _listing(synthetic_run)
  proc = _run_cli(f"--workdir={synthetic_run}", "--prompt_ids=5,6,7", "--max_new_tokens=5")
  assert proc.returncode == 0, proc.stderr
  assert _listing(synthetic_run) == before  # sampling writes nothing into the run
  header, line = proc.stdout.strip().splitlines()
  assert header == f"=== prompt 1, sample 1/1 (greedy) from step {STEPS} ==="
  prompt, new = line.split(" | ")
  assert prompt == "5,6,7" and len(new.split(",")) == 5
  assert all(0 <= int(i) < 97 for i in new.split(","))


def test_cli_refuses_a_synthetic_run_without_ids(synthetic_run):
  proc = _run_cli(f"--workdir={synthetic_run}", "--prompt=def ")
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "data.source='synthetic'" in lines[0], proc.stderr


@pytest.mark.parametrize("make_checkpoints_dir", [False, True])
def test_cli_refuses_a_workdir_without_checkpoints(tmp_path, make_checkpoints_dir):
  if make_checkpoints_dir:
    (tmp_path / "checkpoints").mkdir()
  proc = _run_cli(f"--workdir={tmp_path}", "--prompt_ids=5")
  assert proc.returncode == 2
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and f"--workdir {str(tmp_path)!r} holds no checkpoint" in lines[0], (
      proc.stderr)


def test_an_empty_prompt_is_refused(synthetic_run):
  with pytest.raises(sample_prompts.SampleError, match="--prompt_ids holds no token id, got ''"):
    sample_lib.sample(synthetic_run, prompt_ids=[""])
  with pytest.raises(sample_prompts.SampleError, match="give --prompt .* one of the two"):
    sample_lib.sample(synthetic_run)




def _snapshot(root):
  """Every directory and file under `root`, with each file's size and sha256."""
  out = []
  for path, dirs, files in os.walk(root):
    out.append((os.path.relpath(path, root), sorted(dirs)))
    for name in files:
      with open(os.path.join(path, name), "rb") as f:
        data = f.read()
      out.append((os.path.relpath(os.path.join(path, name), root), len(data),
                  hashlib.sha256(data).hexdigest()))
  return sorted(out, key=str)


def _copy_run(synthetic_run, target, *, drop=None, flip=None):
  """A copy of the run's checkpoints in `target`, without step `drop`, with one byte flipped in
  the middle of the largest file of step `flip`'s state (its data file); returns that file."""
  shutil.copytree(os.path.join(synthetic_run, "checkpoints"), target / "checkpoints")
  if drop is not None:
    shutil.rmtree(target / "checkpoints" / str(drop))
  if flip is None:
    return None
  state = target / "checkpoints" / str(flip) / "state"
  path = max((os.path.join(r, n) for r, _, names in os.walk(state) for n in names),
             key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0xFF]))
  return path


def test_a_damaged_newest_checkpoint_is_skipped_for_the_older_one(synthetic_run, tmp_path):
  damaged, older = tmp_path / "damaged", tmp_path / "older"
  flipped = _copy_run(synthetic_run, damaged, flip=4)
  _copy_run(synthetic_run, older, drop=4)
  before = _snapshot(damaged)
  chosen = saved_run.choose_checkpoint(str(damaged))
  assert chosen.step == 2 and f"{damaged}/checkpoints/4: {flipped}" in chosen.skipped
  _, model, step = loaded_run.load_run(str(damaged))
  _, want, want_step = loaded_run.load_run(str(older))
  assert step == want_step == 2
  got_params, want_params = (_flat(nnx.to_pure_dict(nnx.state(m, nnx.Param)))
                             for m in (model, want))
  for key, value in want_params.items():
    np.testing.assert_array_equal(got_params[key], value, err_msg=str(key))
  newest = _flat(nnx.to_pure_dict(nnx.state(loaded_run.load_run(synthetic_run)[1], nnx.Param)))
  assert any(np.abs(newest[k] - v).max() > 0 for k, v in want_params.items())  # 4 is not 2

  proc = _run_cli(f"--workdir={damaged}", "--prompt_ids=5,6,7", "--max_new_tokens=6")
  assert proc.returncode == 0, proc.stderr
  warnings = [line for line in proc.stderr.splitlines() if "damaged checkpoint" in line]
  assert len(warnings) == 1, proc.stderr
  assert f"{damaged}/checkpoints/4: {flipped} differs from its sha256" in warnings[0]
  assert warnings[0].endswith(f"reading the newest intact one, {damaged}/checkpoints/2")
  header, line = proc.stdout.strip().splitlines()
  assert header == "=== prompt 1, sample 1/1 (greedy) from step 2 ==="
  assert line == sample_lib.sample(str(older), prompt_ids=["5,6,7"], max_new_tokens=6)[0].text
  assert _snapshot(damaged) == before  # nothing moved, deleted or written


def test_a_lone_damaged_checkpoint_is_refused_in_one_line(synthetic_run, tmp_path):
  flipped = _copy_run(synthetic_run, tmp_path, drop=2, flip=4)
  before = _snapshot(tmp_path)
  proc = _run_cli(f"--workdir={tmp_path}", "--prompt_ids=5,6,7")
  assert proc.returncode == 2 and not proc.stdout
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr
  assert lines[0].startswith(f"python -m train.sample: error: --workdir {str(tmp_path)!r} holds no intact "
                             f"checkpoint ({tmp_path}/checkpoints/4: {flipped} differs from its "
                             "sha256 digest)")
  assert _snapshot(tmp_path) == before
  with pytest.raises(RunError, match="holds no intact checkpoint"):
    loaded_run.load_run(str(tmp_path))


def test_unreadable_or_missing_checkpoints_are_run_errors(synthetic_run, tmp_path):
  """A checkpoints path that is a file; a checkpoint that matches its (rewritten) digest but
  whose `meta` item orbax cannot parse: one RunError naming the path, not a traceback."""
  (tmp_path / "file_run").mkdir()
  (tmp_path / "file_run" / "checkpoints").write_text("not a directory")
  with pytest.raises(RunError, match="checkpoints is not a directory"):
    saved_run.choose_checkpoint(str(tmp_path / "file_run"))
  run = tmp_path / "bad_meta"
  run.mkdir()
  _copy_run(synthetic_run, run, drop=2)
  step_dir = run / "checkpoints" / "4"
  (step_dir / "meta" / "metadata").write_text('{"config": {')
  digest_lib.write(str(step_dir), 4)  # the digest now matches the unparsable file
  assert saved_run.choose_checkpoint(str(run)).step == 4
  with pytest.raises(RunError, match=f"cannot read {step_dir}: "):
    saved_run.run_config(str(run))


def test_max_new_tokens_past_the_rows_stops_there_with_a_cache_of_what_fits(
    synthetic_run, loaded, monkeypatch):
  _, model, _ = loaded
  sizes, real = [], cache_lib.init_state

  def spy(cfg, *, new_slots, **kwargs):
    sizes.append(new_slots)
    assert new_slots <= 64, f"a KV cache of {new_slots} new slots per lane for rows of 64"
    return real(cfg, new_slots=new_slots, **kwargs)

  monkeypatch.setattr(cache_lib, "init_state", spy)
  prompts = _prompts([4, 9], seed=3)
  huge = engine.generate(model, prompts, max_new_tokens=10**9, max_len=12)
  eight = engine.generate(model, prompts, max_new_tokens=8, max_len=12)
  assert [c.token_ids for c in huge] == [c.token_ids for c in eight]
  assert [c.finish_reason for c in huge] == ["room", "room"]
  assert [c.finish_reason for c in eight] == ["length", "room"]  # 8 asked, 8 fit: the length
  assert sizes == [8, 8]  # the longest room (12 - 4), not the request
  asked = sample_lib.sample(synthetic_run, prompt_ids=["5,6,7"], max_new_tokens=10**30)
  assert [a.new_ids for a in asked] == [a.new_ids for a in sample_lib.sample(
      synthetic_run, prompt_ids=["5,6,7"], max_new_tokens=64)]
  assert max(sizes) <= 64 - 3
  with pytest.raises(sample_prompts.SampleError, match="--max_new_tokens must be an int >= 1, got 0"):
    sample_lib.sample(synthetic_run, prompt_ids=["5"], max_new_tokens=0)


def test_a_prompt_that_fills_the_rows_is_one_line_naming_the_flag_and_the_bound(synthetic_run):
  proc = _run_cli(f"--workdir={synthetic_run}", "--prompt_ids=" + ",".join(["5"] * 64),
                  "--max_new_tokens=1000000000")
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and "--prompt_ids" in lines[0] and "64 positions (packing.seq_len)" in (
      lines[0]), proc.stderr


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-39, 0.0, -0.5, 1.5, float("nan")])
def test_a_top_p_that_is_not_a_float32_in_0_1_is_refused_by_flag(top_p):
  with pytest.raises(sampling_lib.DecodeError, match=r"top_p must be in \(0, 1\]"):
    sampling_lib.Sampling(temperature=1.0, top_p=top_p)
  with pytest.raises(sample_prompts.SampleError, match=r"^--top_p must be in \(0, 1\]"):
    sample_lib.sampling_of(temperature=None, top_k=0, top_p=top_p)

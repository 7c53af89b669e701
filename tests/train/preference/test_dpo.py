"""Preference training on packed pairs against independent oracles: transformers' log-probs of
each sequence run alone, ln 2 at step 0 (with a leak as the negative control), TRL's DPO trainer
(padded) for one step of DPO and of IPO, a toy task learnt, and the one-line errors. The models
and tokenizers are tiny ones made here with transformers; nothing is downloaded."""

import json
import math
import os

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from configs import dpo  # noqa: E402
from segpack import shards  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.data import pairs as pairs_lib  # noqa: E402
from support import hf_models  # noqa: E402
from support import preference_fixtures  # noqa: E402
from support.train_configs import run_cli  # noqa: E402
from train import data_sources as data_sources  # noqa: E402
from train.preference import score as train_score  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402
from train import train as train_lib  # noqa: E402
from train import setup as setup_lib  # noqa: E402
from train.hf import config as hf_config  # noqa: E402
from train.preference import reference as reference_lib  # noqa: E402

LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """A policy and another (reference) model of one tiny word-level tokenizer."""
  root = tmp_path_factory.mktemp("models")
  out = []
  for name, seed in (("policy", 0), ("reference", 1)):
    d = hf_models.make_model(str(root / name), "llama", seed=seed)
    out.append(hf_models.make_tokenizer(d))
  return tuple(out)


def _tokenize(records, root, name, tokenizer):
  """`tokenizer`: a Hugging Face tokenizer directory, or an `spm:` model file."""
  path = preference_fixtures.write_jsonl(root / f"{name}.jsonl", records)
  spec = f"spm:{tokenizer}" if str(tokenizer).endswith(".model") else f"hf:{tokenizer}"
  assert tokenize_cli.main(["--format", "preference", "--input", path, "--tokenizer", spec,
                            "--output", str(root / name)]) == 0
  return root / name


@pytest.fixture(scope="module")
def pairs(models, tmp_path_factory):
  """`uneven`: 30 pairs of very different lengths (many per row of 512); `rows`: 8 pairs of
  38-62 tokens, exactly one per row of 64 slots (a step of 8 rows trains each once)."""
  root = tmp_path_factory.mktemp("pairs")
  _tokenize(preference_fixtures.word_pairs(30, prompt=(1, 60), answer=(1, 80), seed=3), root,
            "uneven", models[0])
  _tokenize(preference_fixtures.word_pairs(8, prompt=(10, 12), answer=(8, 18), seed=5), root,
            "rows", models[0])
  return root


def _config(policy, data, *, seq_len, **keys):
  config = dpo.get_config()
  config.model.init_from = policy
  config.data.train = str(data)
  config.packing.seq_len = seq_len
  config.attention.implementation = "xla"
  config.attention.self_check = False
  t = config.train
  t.batch_size, t.num_steps, t.log_every, t.eval_every, t.checkpoint_every = 8, 1, 1, 0, 0
  t.learning_rate, t.warmup_steps = 1e-3, 0
  for key, value in keys.items():
    group, name = key.split("__")
    config[group][name] = value
  hf_config.adopt(config)
  return config


def _transformers_scores(model_dir, source, *, add_bos):
  """Each sequence run alone through transformers: its completion's summed log-prob (float64)
  and trained tokens, `[pairs, 4]` in `scoring.COLUMNS` order."""
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  model.eval()
  out = np.zeros((len(source) // 2, 4))
  for d in range(len(source)):
    tokens, mask = np.asarray(source[d], np.int64), np.asarray(source.loss_mask(d))
    ids = np.concatenate([[1] * add_bos, tokens, [2]])
    trained = np.concatenate([[0] * add_bos, mask, mask[-1:]]).astype(bool)  # EOS: last's
    with torch.no_grad():
      logits = model(input_ids=torch.as_tensor(ids[None])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.as_tensor(ids[1:, None]))[:, 0]
    out[d // 2, d % 2] = float(logp.numpy()[trained[1:]].sum())
    out[d // 2, 2 + d % 2] = trained[1:].sum()
  return out


@pytest.mark.parametrize("shared", [False, True], ids=["pairs", "shared_prompts"])
def test_packed_scores_equal_transformers_per_sequence(models, pairs, tmp_path, shared):
  rows = pairs_lib.pack_pairs(str(pairs / "uneven"), seq_len=512, shuffle=False, num_epochs=1,
                              shared_prefix=shared)
  assert rows.pairs.pairs_per_row >= 3  # rows hold several pairs of very different lengths
  lengths = shards.ShardSource(pairs / "uneven").lengths
  assert lengths.max() > 4 * lengths.min()
  assert not shared or rows.pairs.stats["shared"] == 30
  flags = ["--shared-prefix"] if shared else []
  assert train_score.main(["--model", models[0], "--data", str(pairs / "uneven"), "--output",
                           str(tmp_path / "scores"), "--seq-len", "512", "--per-token",
                           *flags]) == 0
  got = np.load(tmp_path / "scores" / "dataset.npy")
  want = _transformers_scores(models[0], shards.ShardSource(pairs / "uneven"), add_bos=True)
  np.testing.assert_array_equal(got[:, 2:], want[:, 2:])
  np.testing.assert_allclose(got[:, :2], want[:, :2], rtol=1e-5)
  tokens = np.load(tmp_path / "scores" / "tokens.npz")
  for k in (0, 17):  # per-token log-probs sum to the sequence's score
    a, b = tokens["chosen_offsets"][k:k + 2]
    assert b - a == want[k, 2]
    np.testing.assert_allclose(tokens["chosen"][a:b].sum(dtype=np.float64), want[k, 0],
                               rtol=1e-5)
  # Negative control: the other model's scores are far from these.
  other = _transformers_scores(models[1], shards.ShardSource(pairs / "uneven"), add_bos=True)
  assert np.abs(other[:, :2] - want[:, :2]).max() > 1.0


@pytest.mark.parametrize("data_devices", [1, 8])
def test_a_pass_smaller_than_a_batch_computes_only_its_rows(pairs, data_devices):
  """`score_pairs` with a batch of 64 rows over a pass of a few: the step sees the pass's rows
  rounded up to the mesh's data devices, not 64 (most of them all padding), and every pair is
  scored once. The step is a stand-in that returns each pair's index as its score."""
  import jax
  from train.preference import scoring
  rows = pairs_lib.pack_pairs(str(pairs / "uneven"), seq_len=512, shuffle=False, num_epochs=1)
  assert 8 < len(rows) < 16
  seen = []

  def step(params, batch):  # pylint: disable=unused-argument
    seen.append(batch["segment_ids"].shape)
    index = batch["pair_index"].astype(np.float32)
    return {"pair_index": batch["pair_index"], **{c: index for c in scoring.COLUMNS}}

  mesh = sharding_lib.make_mesh(data=data_devices, devices=jax.devices()[:data_devices])
  table, _ = scoring.score_pairs(step=step, params={}, rows=rows, mesh=mesh, batch_size=64,
                                 num_pairs=30)
  assert seen == [(len(rows) if data_devices == 1 else 16, 512)]
  np.testing.assert_array_equal(table, np.arange(30)[:, None] * np.ones(4))


def _batches(run):
  """Every training batch of epoch 0, then every held-out batch, as global arrays."""
  epoch = -(-run.data.train_rows_in_epoch0 // run.config.train.batch_size)
  for i in range(epoch):
    yield sharding_lib.global_batch(run.data.train[i], run.mesh)
  for i in range(len(run.data.eval)):
    yield sharding_lib.global_batch(run.data.eval[i], run.mesh)


@pytest.mark.parametrize("shared", [False, True], ids=["pairs", "shared_prompts"])
def test_dpo_loss_is_ln2_at_step_0_on_every_batch_and_a_leak_is_not(models, pairs, tmp_path,
                                                                   shared):
  config = _config(models[0], pairs / "uneven", seq_len=512, data__eval_share=0.2,
                   preference__shared_prefix=shared)
  run = setup_lib.setup(config, str(tmp_path / "run"))
  assert os.path.exists(tmp_path / "run" / "reference" / "scores.json")
  params = run.state["params"]
  for batch in _batches(run):
    out = run.eval_step(params, batch)
    assert float(out["count"]) > 0
    assert abs(float(out["loss_sum"]) / float(out["count"]) - LN2) <= 1e-6
    assert float(out["reward_chosen"]) == 0.0 and float(out["reward_rejected"]) == 0.0
  # Negative control: rejected tokens that see their chosen sibling (one segment per pair, as
  # a padding-free collator that leaks across segments would give) move the loss off ln 2.
  batch = dict(next(_batches(run)))
  seg = np.array(batch["segment_ids"])
  rejected, chosen = np.asarray(batch["pair_rejected_segment"]), np.asarray(
      batch["pair_chosen_segment"])
  for r in range(seg.shape[0]):
    for c, j in zip(chosen[r], rejected[r]):
      if j:
        seg[r][seg[r] == j] = c
  batch["segment_ids"] = sharding_lib.global_batch({"segment_ids": seg}, run.mesh)["segment_ids"]
  batch["pair_rejected_segment"] = batch["pair_chosen_segment"]  # the sum reads that segment
  leaked = run.eval_step(params, batch)
  assert abs(float(leaked["loss_sum"]) / float(leaked["count"]) - LN2) > 1e-3
  run.checkpointer.close()


def test_first_training_step_starts_at_ln2(models, pairs, tmp_path):
  config = _config(models[0], pairs / "uneven", seq_len=512)
  train_lib.train_and_evaluate(config, tmp_path / "run")
  first = next(json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
               if json.loads(line)["kind"] == "train")
  assert abs(first["loss"] - LN2) <= 1e-5 and abs(first["reward_margin"]) <= 1e-4


def _trl_step(models, records, *, loss_type, beta, output_dir):
  """TRL's DPO trainer (padded batches) on `records`: the loss and gradient norm of one step
  over all of them, from its own `compute_loss`."""
  import datasets
  import torch
  import transformers
  import trl
  policy, reference = (transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
                       for d in models)
  tokenizer = transformers.AutoTokenizer.from_pretrained(models[0])
  args = trl.DPOConfig(output_dir=str(output_dir), per_device_train_batch_size=len(records),
                       beta=beta, loss_type=[loss_type], report_to=[], use_cpu=True,
                       max_length=None, logging_steps=1, bf16=False)  # float32, as segpack
  trainer = trl.DPOTrainer(model=policy, ref_model=reference, args=args,
                           train_dataset=datasets.Dataset.from_list(records),
                           processing_class=tokenizer)
  batch = next(iter(trainer.get_train_dataloader()))
  policy.train()
  loss = trainer.compute_loss(trainer.model, batch)
  loss.backward()
  norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in policy.parameters()
                       if p.grad is not None))
  return float(loss), norm


@pytest.mark.parametrize("loss_type", ["dpo", "ipo"])
def test_one_step_equals_trl_dpo_trainer(models, pairs, tmp_path, loss_type):
  records = [json.loads(line) for line in open(pairs / "rows.jsonl")]
  # TRL adds no BOS to text pairs and appends EOS to each completion: the same sequences.
  scores = tmp_path / "reference_scores"
  assert train_score.main(["--model", models[1], "--data", str(pairs / "rows"), "--output",
                           str(scores), "--seq-len", "64", "--no-bos"]) == 0
  config = _config(models[0], pairs / "rows", seq_len=64, preference__loss=loss_type,
                   preference__reference=str(scores), data__eval_share=0.0,
                   data__add_bos=False)
  train_lib.train_and_evaluate(config, tmp_path / "run")
  first = next(json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
               if json.loads(line)["kind"] == "train")
  want_loss, want_norm = _trl_step(models, records, beta=0.1, output_dir=tmp_path / "trl",
                                   loss_type="sigmoid" if loss_type == "dpo" else "ipo")
  assert abs(want_loss - LN2) > 1e-3  # another reference: not the trivial step-0 value
  assert abs(first["loss"] - want_loss) <= 1e-5 * abs(want_loss), (first["loss"], want_loss)
  assert abs(first["grad_norm"] - want_norm) <= 1e-5 * want_norm, (first["grad_norm"], want_norm)


def test_reward_accuracy_on_held_out_pairs_rises_on_a_toy_task(models, tmp_path):
  words = tuple(hf_models.TOKENS[:40])
  records = []
  rng = np.random.default_rng(0)
  for _ in range(400):  # chosen counts up from the prompt, rejected counts down
    i = int(rng.integers(4, 32))
    records.append(dict(prompt=" ".join(words[i - 3:i + 1]),
                        chosen=" " + " ".join(words[i + 1:i + 5]),
                        rejected=" " + " ".join(reversed(words[i - 4:i]))))
  data = _tokenize(records, tmp_path, "toy", models[0])
  config = dpo.get_config("smoke")
  config.data.train = str(data)
  config.data.eval_share = 0.1
  config.packing.seq_len = 128
  config.attention.self_check = False
  t = config.train
  # 30 steps: accuracy 1.0 and a final loss far below 0.5 ln 2 from step 20 on (measured)
  t.batch_size, t.num_steps, t.learning_rate, t.warmup_steps = 8, 30, 5e-3, 8
  t.eval_every, t.log_every, t.checkpoint_every, t.eval_batches = 30, 15, 0, 0
  config.preference.beta = 0.5
  summary = train_lib.train_and_evaluate(config, tmp_path / "run")
  evals = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
           if json.loads(line)["kind"] == "eval"]
  assert evals[0]["eval_reward_accuracy"] == 0.0  # margins are exactly 0 at step 0
  assert evals[-1]["step"] == 30 and evals[-1]["eval_reward_accuracy"] > 0.9, evals[-1]
  assert summary["final_loss"] < 0.5 * LN2


def test_bad_pairs_and_mismatched_references_are_one_line_errors(models, pairs, tmp_path,
                                                                capsys):
  bad = preference_fixtures.write_jsonl(tmp_path / "bad.jsonl", [
      dict(prompt="w1 w2", chosen=" w3", rejected=" w4"),
      dict(prompt="w1 w2", chosen=" w3", rejected=" w3")])
  assert tokenize_cli.main(["--format", "preference", "--input", bad, "--tokenizer",
                            f"hf:{models[0]}", "--output", str(tmp_path / "bad")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "bad.jsonl:2" in err and "chosen equals rejected" in err
  # A preference loss on a dataset of plain documents.
  text = hf_models.write_text_jsonl(str(tmp_path / "docs.jsonl"), 10)
  assert tokenize_cli.main(["--input", text, "--tokenizer", f"hf:{models[0]}", "--output",
                            str(tmp_path / "docs")]) == 0
  args = ["train.main", "--config=configs/dpo.py:smoke", f"--config.model.init_from={models[0]}",
          "--config.attention.self_check=False", "--config.packing.seq_len=512"]
  with pytest.raises(data_sources.DataConfigError, match="not a preference dataset"):
    train_lib.train_and_evaluate(_config(models[0], tmp_path / "docs", seq_len=512),
                                 tmp_path / "w0")
  # Reference scores of another dataset.
  train_lib.train_and_evaluate(_config(models[0], pairs / "rows", seq_len=512),
                               tmp_path / "w1")
  out = run_cli(*args, f"--config.data.train={pairs / 'uneven'}", f"--workdir={tmp_path / 'w2'}",
                f"--config.preference.reference={tmp_path / 'w1' / 'reference'}", check=False)
  assert out.returncode == 2 and "reference scores" in out.stderr, out.stderr[-2000:]
  # The run's own stored scores, of another reference model, on resume.
  manifest = tmp_path / "w1" / "reference" / "scores.json"
  stored = json.loads(manifest.read_text())
  manifest.write_text(json.dumps(dict(stored, fingerprint="init_from:another")))
  resumed = _config(models[0], pairs / "rows", seq_len=512)
  resumed.train.num_steps = 2
  with pytest.raises(reference_lib.ReferenceError, match="init_from:another"):
    train_lib.train_and_evaluate(resumed, tmp_path / "w1")


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_reference_free_losses_start_from_transformers_scores(models, pairs, tmp_path, loss):
  """SimPO's and ORPO's first step over all 8 pairs equals their formulas on transformers'
  per-sequence scores; they need no reference, so none is scored."""
  config = _config(models[0], pairs / "rows", seq_len=64, preference__loss=loss,
                   preference__beta=2.0, data__eval_share=0.0)
  train_lib.train_and_evaluate(config, tmp_path / "run")
  assert not os.path.exists(tmp_path / "run" / "reference")
  first = next(json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
               if json.loads(line)["kind"] == "train")
  s = _transformers_scores(models[0], shards.ShardSource(pairs / "rows"), add_bos=True)
  c, r = s[:, 0] / s[:, 2], s[:, 1] / s[:, 3]
  if loss == "simpo":
    want = np.log1p(np.exp(-(2.0 * (c - r) - 0.5)))
  else:
    odds = (c - np.log1p(-np.exp(c))) - (r - np.log1p(-np.exp(r)))
    want = -c + 2.0 * np.log1p(np.exp(-odds))
  assert abs(first["loss"] - want.mean()) <= 1e-5 * abs(want.mean()), (first["loss"], want)
  assert first["reward_accuracy"] == pytest.approx(np.mean(c > r))


def test_held_out_pairs_of_another_tokenizer_are_refused(models, pairs, tmp_path, model):
  """`data.eval` pairs tokenized by another tokenizer (the built-in corpus's SentencePiece model)
  than `data.train`'s (the policy's): refused by name before a step, as plain data.eval is."""
  other = _tokenize(preference_fixtures.word_pairs(8, prompt=(10, 12), answer=(8, 18), seed=7),
                    tmp_path, "other", model)
  config = _config(models[0], pairs / "rows", seq_len=64, data__eval=str(other))
  with pytest.raises(data_sources.DataConfigError,
                     match=rf"data.eval='{other}' \(tokenizer sha256:\w+\) were tokenized "):
    train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()

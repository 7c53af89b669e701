"""A new objective is one module: a z-loss-only objective written here, in the test alone, is
trained by `train.train.train_and_evaluate(config, workdir, objective=...)` with no change to the
trainer, its metrics logged and evaluated as the token loss's are.

The oracle of the first step's loss is the z-loss computed here with NumPy from the initial
model's logits of the first batch (the run's own setup gives both); the negative control is the
token loss of the same run, which the z-loss run's first loss is not.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from support import train_configs
from train import setup as setup_lib
from train import sharding as sharding_lib
from train import train as train_lib
from train.objective import TokenObjective

IGNORE = -100


@dataclasses.dataclass(frozen=True)
class ZLoss:
  """The mean over the trained tokens of `logsumexp(logits)^2` (PaLM's z-loss), alone."""

  def make_data(self, config, **layout):
    return TokenObjective().make_data(config, **layout)  # the token loss's rows

  def prepare(self, prepared):
    return self, "objective: z-loss only"

  def batch_sharding(self, mesh):
    return sharding_lib.batch_sharding(mesh)

  def normalizer(self, batch):
    return jnp.sum(batch["labels"] != IGNORE, dtype=jnp.float32)

  def zeros(self):
    return dict(z_sum=jnp.float32(0))

  def _z_sum(self, model, batch):
    logits_BxSxV = model.batch_logits(batch)
    z_BxS = jax.nn.logsumexp(logits_BxSxV, axis=-1)
    return jnp.sum(jnp.where(batch["labels"] != IGNORE, z_BxS ** 2, 0.0))

  def loss_and_sums(self, model, batch, total):
    z_sum = self._z_sum(model, batch)
    return z_sum / jnp.maximum(total, 1.0), dict(z_sum=jax.lax.stop_gradient(z_sum))

  def eval_sums(self, model, batch):
    return dict(loss_sum=self._z_sum(model, batch), count=self.normalizer(batch))

  def window_means(self, window, counts):
    return dict(z=sum(float(m["z_sum"]) for m in window) / max(counts, 1.0))

  def describe(self, record, prefix=""):
    return f" | z {record[prefix + 'z']:.3f}" if prefix + "z" in record else ""


def _config():
  return train_configs.synthetic_config(**{"train.num_steps": 4, "train.log_every": 1,
                                           "train.eval_every": 4, "train.checkpoint_every": 0,
                                           "train.learning_rate": 1e-2, "train.warmup_steps": 0})


def _records(workdir):
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def test_a_toy_objective_from_a_test_file_trains_with_no_change_to_the_trainer(tmp_path, capsys):
  config = _config()
  z_run = train_lib.train_and_evaluate(config, tmp_path / "z", objective=ZLoss())
  printed = capsys.readouterr().out
  records = _records(tmp_path / "z")
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == [1, 2, 3, 4]
  assert all("z" in r for r in train) and "| z " in printed  # its own metric, logged and printed
  assert "objective: z-loss only" in printed  # its preparation ran before step 1
  # The loss is the z-loss: the mean over trained tokens of logsumexp^2 equals its own metric.
  assert all(abs(r["loss"] - r["z"]) <= 1e-6 * max(1.0, r["z"]) for r in train)
  assert train[-1]["loss"] < 0.9 * train[0]["loss"]  # trained: the z-loss falls
  evals = [r for r in records if r["kind"] == "eval"]
  assert evals and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
  assert z_run["final_loss"] == train[-1]["loss"]

  # Oracle: the first step's loss from the initial model's logits of the first batch, NumPy.
  probe = setup_lib.setup(_config(), str(tmp_path / "probe"), objective=ZLoss())
  batch = jax.device_get(sharding_lib.global_batch(next(probe.iterator), probe.mesh))
  model = nnx.merge(probe.graphdef, probe.state["params"])
  logits = np.asarray(model.batch_logits(batch), np.float64)
  peak = logits.max(-1)
  z = peak + np.log(np.exp(logits - peak[..., None]).sum(-1))
  trained = np.asarray(batch["labels"]) != IGNORE
  want = float((z[trained] ** 2).sum() / trained.sum())
  probe.checkpointer.close()
  assert abs(train[0]["loss"] - want) <= 1e-5 * want

  # Negative control: the token loss of the same run starts elsewhere.
  token = train_lib.train_and_evaluate(_config(), tmp_path / "tokens")
  assert abs(token["first_logged_loss"] - want) > 0.1 * want

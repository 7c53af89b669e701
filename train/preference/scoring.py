"""The packed scoring pass: every pair's summed completion log-probs, one forward per batch.

`score_pairs` walks one unshuffled epoch of pair rows (`pack_pairs(..., shuffle=False,
num_epochs=1)`), runs the model once per global batch under `jax.jit` with the run's shardings,
and writes each pair's four numbers into a table indexed by pair: the chosen and rejected
completions' summed log-probs and their trained tokens. Every pair is scored exactly once
(checked). With `per_token=True` it also returns each completion's token log-probs in order.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from segpack.loss import IGNORE_INDEX
from segpack.loss import preference as preference_loss
from segpack.data.stream import StreamBatches
from segpack.mesh import BATCH_AXES
from train.model import head_loss
from train.model import lora as lora_lib
from train import sharding as sharding_lib

__all__ = ["COLUMNS", "make_score_step", "score_pairs"]

COLUMNS = ("chosen_logp", "rejected_logp", "chosen_tokens", "rejected_tokens")


def make_score_step(graphdef: Any, *, block_size: int = 0, vocab_block_size: int = 0,
                    per_token: bool = False) -> Callable[..., dict[str, jax.Array]]:
  """`(params, batch) -> {COLUMNS..., "pair_index"}` (`[B, J]` each; with `per_token`, also
  `token_logp` `[B, S]`, the log-prob of every slot's label)."""

  def step(params, batch):
    model = lora_lib.model_of(graphdef, params)  # `(adapters, frozen base)` under adapters
    token_logp_BxS = -head_loss.token_losses(model, batch, block_size=block_size,
                                             vocab_block_size=vocab_block_size)
    out = preference_loss.pair_logps(token_logp_BxS, batch["labels"], batch["segment_ids"],
                                     batch["pair_chosen_segment"],
                                     batch["pair_rejected_segment"])
    out["pair_index"] = batch["pair_index"]
    if per_token:
      out["token_logp"] = token_logp_BxS
    return out

  return step


def _token_runs(out: dict[str, np.ndarray], batch: dict[str, np.ndarray],
                runs: dict[int, list[np.ndarray]]) -> None:
  """Each completion's token log-probs of a scored batch, in slot order, into `runs`."""
  trained_BxS = batch["labels"] != IGNORE_INDEX
  for b, j in zip(*np.nonzero(out["pair_index"] >= 0)):
    k = int(out["pair_index"][b, j])
    runs[k] = [out["token_logp"][b][(batch["segment_ids"][b] == batch[f"pair_{w}_segment"][b, j])
                                     & trained_BxS[b]] for w in ("chosen", "rejected")]


def _pass_batch_size(batch_size: int, num_rows: int, mesh: Any) -> int:
  """`batch_size`, or fewer rows when the whole pass is smaller than one batch: its rows rounded
  up to what the batch's devices and the processes split evenly (no all-padding rows computed)."""
  unit = math.lcm(jax.process_count(), math.prod(mesh.shape[a] for a in BATCH_AXES))
  return min(batch_size, max(1, -(-num_rows // unit)) * unit)


def score_pairs(*, step: Callable[..., Any], params: Any, rows: Any, mesh: Any,
                batch_size: int, num_pairs: int, per_token: bool = False,
                ) -> tuple[np.ndarray, dict[int, list[np.ndarray]] | None]:
  """Scores every pair of `rows` once.

  Args:
    step: `make_score_step(...)`, jitted here with the batch sharded over the mesh.
    params: the model's parameters (placed as the run places them).
    rows: one unshuffled epoch of pair rows (`pack_pairs(..., shuffle=False, num_epochs=1)`).
    mesh: the run's mesh.
    batch_size: rows per global batch (this process reads its block of each); a pass of fewer
      rows runs only those, rounded up to split evenly over the batch's devices and processes.
    num_pairs: the pairs the table holds (pair indices of `rows` lie in `[0, num_pairs)`).
    per_token: also return every pair's `[chosen, rejected]` token log-probs.

  Returns:
    `(table, runs)`: float64 `[num_pairs, 4]` in `COLUMNS` order (NaN for a pair the plan
    dropped), and the token log-probs by pair (None without `per_token`).

  Raises:
    RuntimeError: a pair scored twice (a bug: rows hold each pair once).
  """
  batches = StreamBatches(rows, global_batch_size=_pass_batch_size(batch_size, len(rows), mesh),
                          process_index=jax.process_index(), process_count=jax.process_count())
  jitted = jax.jit(step, out_shardings=NamedSharding(mesh, P()))
  table = np.full((num_pairs, len(COLUMNS)), np.nan)
  seen = np.zeros(num_pairs, np.int64)
  runs: dict[int, list[np.ndarray]] | None = {} if per_token else None
  for i in range(len(batches)):
    local = batches[i]
    out = jax.device_get(jitted(params, sharding_lib.global_batch(local, mesh)))
    index = out["pair_index"]
    valid = index >= 0
    np.add.at(seen, index[valid], 1)
    for c, name in enumerate(COLUMNS):
      table[index[valid], c] = out[name][valid]
    if runs is not None and jax.process_count() == 1:
      _token_runs(out, local, runs)
  if (seen > 1).any():
    raise RuntimeError(f"score_pairs: pair {int(np.argmax(seen > 1))} was scored "
                       f"{int(seen.max())} times; rows must hold each pair once")
  return table, runs

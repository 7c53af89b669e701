"""The RL run's batches: rounds of sampling, scoring and packing, served step by step.

Algorithm (`Rollouts`, the iterator the training loop reads):
  1. Round `r` draws its prompts (`train.rl.prompts`) and samples `rl.num_generations`
     completions of each with the current weights, every prompt prefilled once
     (`train.rollout.engine.generate`, seeded by `(train.seed, r)`).
  2. The rewards score every completion (`train.rl.rewards`); advantages are computed group by
     group (`train.rl.advantages`); with `drop_equal_groups`, groups whose completions all got one
     reward are left out (they carry no signal).
  3. The groups are packed whole (`segpack.packing.groups.plan_groups`, exact FFD; the prompt
     once per group with `rl.shared_prompt`), written as rows (`segpack.data.groups.group_rows`)
     and cut into steps of `train.batch_size` rows (the last one filled with empty rows); with
     `mask_truncated`, completions cut at `rl.max_completion_length` train no token.
  4. The old log-probs (the weights that sampled, on the training layout) and, with a KL term,
     the reference's are computed for every step's rows before the first update; the round's
     steps are kept in `WORKDIR/rollouts/round-R.npz` and its completions in `round-R.jsonl`.
  5. The round's steps are served `rl.inner_steps` times over; then round `r + 1` begins.

The iterator's state is `{"version": 1, "unit": "steps", "epoch": r, "index": k,
"epoch_length": n}`: step `k` of round `r`'s `n`. A run resumed inside a round reads the round's
steps back from its `.npz` file, so it trains on exactly what the uninterrupted run did.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import time
from typing import Any, Callable

import numpy as np

from segpack.data import groups as group_rows_lib
from segpack.errors import UserError
from segpack.files import atomic_write_bytes
from segpack.loss.labels import IGNORE_INDEX
from segpack.packing import groups as groups_lib
from train.rl import advantages as advantages_lib
from train.rl import rewards as rewards_lib
from train.rl.prompts import Prompts, record_line
from train.rl import settings as settings_lib
from train.rollout import engine

ROLLOUTS_DIR = "rollouts"
ENTROPY = "entropy"  # the scoring pass's per-slot entropy: a metric, never served as a feature
TRUNCATED = ("length", "room")


class RolloutStateError(UserError, ValueError):
  """A resumed round whose steps cannot be read back."""


@dataclasses.dataclass
class Bound:
  """What the objective binds before step 1: the current model, and the scoring of rows."""

  model: Callable[[], Any]
  score: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def _seed(seed: int, round_index: int) -> int:
  return int(np.random.SeedSequence([int(seed), int(round_index)]).generate_state(1)[0] >> 1)


class Rollouts:
  """The iterator of the module's algorithm (`next`, `get_state`, `set_state`)."""

  def __init__(self, *, prompts: Prompts, config: Any, rewards: list[Any], batch_size: int,
               workdir: str):
    self.prompts, self.rl, self.rewards = prompts, config.rl, rewards
    self.sampling = settings_lib.sampling_of(config)
    self.estimator = settings_lib.estimator_of(config)
    self.scale_rewards = settings_lib.scale_rewards_of(config.rl.loss, config.rl.scale_rewards)
    self.drop_equal_groups = settings_lib.dapo_default(config, "drop_equal_groups")
    self.mask_truncated = settings_lib.dapo_default(config, "mask_truncated")
    seq_len, seed = int(config.packing.seq_len), int(config.train.seed)
    self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
    self.directory = os.path.join(workdir, ROLLOUTS_DIR)
    self.bound: Bound | None = None
    self.round, self.index, self.steps = 0, 0, None
    self.metrics: dict[str, Any] = {}
    self._last = time.perf_counter()

  def bind(self, bound: Bound) -> None:
    self.bound = bound

  def evaluate(self, held: Prompts, *, limit: int) -> dict[str, Any]:
    """Greedy completions of the first `limit` held-out prompts (all when 0), rewarded:
    `eval_reward`, `eval_accuracy` (the first reward > 0), `eval_completion_length`, and
    `eval_loss` = minus the mean reward (lower is better, as every eval loss)."""
    n = len(held.ids) if limit <= 0 else min(limit, len(held.ids))
    done = engine.generate(self.bound.model(), held.ids[:n],
                           max_new_tokens=self.rl.max_completion_length,
                           stop_ids=held.stop_ids, detokenize=held.detokenize,
                           max_len=self.seq_len, lanes=self.rl.lanes or None)
    values = np.zeros((n, len(self.rewards)))
    totals = np.zeros(n)
    for c in done:
      sample = rewards_lib.Sample(prompt=held.texts[c.prompt], completion=c.text,
                                  record=held.records[c.prompt],
                                  where=f"held-out {held.name!r} record {c.prompt}",
                                  num_tokens=len(c.token_ids),
                                  max_tokens=self.rl.max_completion_length)
      totals[c.prompt], values[c.prompt] = rewards_lib.score(self.rewards, sample)
    tokens = sum(len(c.token_ids) for c in done)
    return dict(eval_loss=-float(totals.mean()), eval_tokens=int(tokens),
                eval_reward=float(totals.mean()),
                eval_accuracy=float((values[:, 0] > 0).mean()) if values.shape[1] else None,
                eval_completion_length=tokens / max(n, 1), eval_prompts=n)

  def get_state(self) -> dict[str, Any]:
    length = len(self.steps) * self.rl.inner_steps if self.steps else 1
    return dict(version=1, unit="steps", epoch=self.round, index=self.index,
                epoch_length=length)

  def set_state(self, state: dict[str, Any]) -> None:
    self.round, self.index, self.steps = int(state["epoch"]), int(state["index"]), None
    if self.index >= int(state["epoch_length"]):
      self.round, self.index = self.round + 1, 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.steps is not None and self.index >= len(self.steps) * self.rl.inner_steps:
      self.round, self.index, self.steps = self.round + 1, 0, None
    if self.steps is None:  # inside a round only after a resume: its steps are on disk
      self.steps = (self._read_round(self.round) if self.index else
                    self._make_round(self.round))
    batch = self.steps[self.index % len(self.steps)]
    self.index += 1
    return batch

  def _path(self, round_index: int, suffix: str) -> str:
    return os.path.join(self.directory, f"round-{round_index:06d}{suffix}")

  def _read_round(self, round_index: int) -> list[dict[str, np.ndarray]]:
    path = self._path(round_index, ".npz")
    try:
      with np.load(path) as z:
        count = int(z["steps"])
        return [{k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"{s}/")}
                for s in range(count)]
    except (OSError, KeyError, ValueError) as e:
      raise RolloutStateError(
          f"cannot resume inside RL round {round_index}: its steps ({path}) cannot be read "
          f"({type(e).__name__}: {e}); start a new --workdir") from e

  def _make_round(self, round_index: int) -> list[dict[str, np.ndarray]]:
    """Steps 1-4 of the algorithm for one round."""
    s, p = self.rl, self.prompts
    began = time.perf_counter()
    chosen = p.round_prompts(round_index, s.prompts_per_step, seed=self.seed)
    done = engine.generate(
        self.bound.model(), [p.ids[i] for i in chosen], num_samples=s.num_generations,
        max_new_tokens=s.max_completion_length, sampling=self.sampling,
        seed=_seed(self.seed, round_index), stop_ids=p.stop_ids, detokenize=p.detokenize,
        max_len=self.seq_len, lanes=s.lanes or None)
    sampled = time.perf_counter()
    groups = [[c for c in done if c.prompt == g] for g in range(len(chosen))]
    totals, values = self._rewards(chosen, groups)
    adv = advantages_lib.advantages(totals, estimator=self.estimator,
                                      scale=self.scale_rewards)
    keep = [g for g in range(len(chosen))
            if not self.drop_equal_groups or np.ptp(totals[g]) > 0]
    steps = self._steps(chosen, groups, adv, keep)
    entropy = [step.pop(ENTROPY, None) for step in steps]
    scored = time.perf_counter()
    self._keep(round_index, chosen, groups, totals, values, adv, steps)
    self.metrics = _round_metrics(self, groups, totals, values, steps, keep, times=dict(
        sample_s=sampled - began, score_s=scored - sampled, update_s=began - self._last))
    if all(e is not None for e in entropy):
      labelled = [st["labels"] != IGNORE_INDEX for st in steps]
      tokens = sum(int(m.sum()) for m in labelled)
      self.metrics["entropy"] = (sum(float(e[m].sum()) for e, m in zip(entropy, labelled))
                                 / max(tokens, 1))
    self._last = time.perf_counter()
    return steps

  def _rewards(self, chosen: list[int], groups: list[list[Any]]) -> tuple[np.ndarray, np.ndarray]:
    s, p = self.rl, self.prompts
    totals = np.zeros((len(chosen), s.num_generations))
    values = np.zeros((len(chosen), s.num_generations, len(self.rewards)))
    for g, i in enumerate(chosen):
      for c in groups[g]:
        sample = rewards_lib.Sample(prompt=p.texts[i], completion=c.text, record=p.records[i],
                                    where=f"data.train={p.name!r} record {i}",
                                    num_tokens=len(c.token_ids),
                                    max_tokens=s.max_completion_length)
        totals[g, c.sample], values[g, c.sample] = rewards_lib.score(self.rewards, sample)
    return totals, values

  def _steps(self, chosen, groups, adv, keep) -> list[dict[str, np.ndarray]]:
    """Step 3 and 4: the kept groups packed, cut into steps, scored."""
    s, p = self.rl, self.prompts
    if not keep:
      empty = _empty(self.batch_size, self.seq_len)
      if not s.shared_prompt:
        empty.pop("prefix_segment_ids")
      return [self.bound.score(empty)]
    comps = [[list(c.token_ids) for c in groups[g]] for g in keep]
    plan = groups_lib.plan_groups(
        prompt_lengths=[p.ids[chosen[g]].size for g in keep],
        completion_lengths=[[len(c) for c in cs] for cs in comps], seq_len=self.seq_len,
        layout="shared" if s.shared_prompt else "copied")
    rows = group_rows_lib.group_rows(
        plan, prompts=[p.ids[chosen[g]] for g in keep], completions=comps,
        completion_values={"advantages": [adv[g] for g in keep]},
        token_values={"sampler_logp": [[c.logprobs for c in groups[g]] for g in keep]})
    if not s.shared_prompt:
      rows.pop("prefix_segment_ids")
    if self.mask_truncated:
      cut = [n for n, c in enumerate(c for g in keep for c in groups[g])
             if c.finish_reason in TRUNCATED]
      rows["labels"][np.isin(rows["completion_index"], cut)] = IGNORE_INDEX
    out = []
    for first in range(0, plan.num_rows, self.batch_size):
      part = {k: v[first:first + self.batch_size] for k, v in rows.items()}
      pad = self.batch_size - len(part["labels"])
      part = {k: np.pad(v, ((0, pad), (0, 0)), constant_values=_fill(k)) for k, v in part.items()}
      out.append(self.bound.score(part))
    return out

  def _keep(self, round_index, chosen, groups, totals, values, adv, steps) -> None:
    """Step 4's files: the round's steps (for a resume) and its completions (for people)."""
    os.makedirs(self.directory, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, steps=np.asarray(len(steps)),
             **{f"{n}/{k}": v for n, step in enumerate(steps) for k, v in step.items()})
    atomic_write_bytes(pathlib.Path(self._path(round_index, ".npz")), buffer.getvalue())
    lines = []
    names = [r.name for r in self.rewards]
    for g, i in enumerate(chosen):
      for c in groups[g]:
        lines.append(json.dumps(dict(
            round=round_index, prompt_index=i, record=json.loads(record_line(
                self.prompts.records[i])), prompt=self.prompts.texts[i], sample=c.sample,
            completion=c.text, token_ids=[int(t) for t in c.token_ids],
            logprobs=[float(x) for x in c.logprobs], finish_reason=c.finish_reason,
            reward=float(totals[g, c.sample]),
            rewards=dict(zip(names, map(float, values[g, c.sample]))),
            advantage=float(adv[g, c.sample])), ensure_ascii=False))
    atomic_write_bytes(pathlib.Path(self._path(round_index, ".jsonl")), ("\n".join(lines) + "\n").encode())


def _fill(name: str) -> int:
  return IGNORE_INDEX if name == "labels" else (-1 if name == "completion_index" else 0)


def _empty(batch_size: int, seq_len: int) -> dict[str, np.ndarray]:
  """A step of empty rows (every group of the round dropped): it trains nothing."""
  rows = {k: np.zeros((batch_size, seq_len), np.int32)
          for k in ("input_ids", "segment_ids", "segment_positions", "prefix_segment_ids")}
  rows["labels"] = np.full((batch_size, seq_len), IGNORE_INDEX, np.int32)
  rows["completion_index"] = np.full((batch_size, seq_len), -1, np.int32)
  rows.update(advantages=np.zeros((batch_size, seq_len), np.float32),
              sampler_logp=np.zeros((batch_size, seq_len), np.float32))
  return rows


def _round_metrics(source: Rollouts, groups, totals, values, steps, keep, *,
                   times: dict[str, float]) -> dict[str, Any]:
  """What the train record says of the round (docs/rl.md lists each)."""
  flat = [c for cs in groups for c in cs]
  lengths = np.asarray([len(c.token_ids) for c in flat])
  out = {"reward": float(totals.mean()), "reward_std": float(totals.std()),
         "accuracy": float((values[..., 0] > 0).mean()) if values.shape[-1] else None,
         "completion_length": float(lengths.mean()), "completion_length_max": int(lengths.max()),
         "truncated_share": float(np.mean([c.finish_reason in TRUNCATED for c in flat])),
         "groups_dropped": len(groups) - len(keep), **times}
  for n, reward in enumerate(source.rewards):
    out[f"rewards/{reward.name}"] = float(values[..., n].mean())
    out[f"rewards/{reward.name}_std"] = float(values[..., n].std())
  labelled = np.concatenate([(st["labels"] != IGNORE_INDEX).ravel() for st in steps])
  if labelled.any():
    old = np.concatenate([st["old_logp"].ravel() for st in steps])[labelled]
    sampler = np.concatenate([st["sampler_logp"].ravel() for st in steps])[labelled]
    gap = old - sampler
    out["logp_mismatch_median"] = float(np.median(np.abs(gap)))
    out["logp_ratio_outside"] = float(np.mean(np.abs(np.exp(gap) - 1) > 0.1))
  return out

"""The RL objective: the GRPO family's clipped loss on packed groups of the run's own samples.

`RLObjective` is a `train.objective.Objective`: its batches come from `train.rl.rollouts.Rollouts`
(sampled with the current weights, rewarded, packed whole), and its loss of a step is
`segpack.loss.policy.PolicyLoss` over the completion tokens, with the policy's log-probs from
the trainer's own forward and per-token loss at the sampling temperature
(`train.model.head_loss.token_losses`, full or blocked). The old log-probs are computed on the
same rows before the round's first update, so the ratio of the first inner step is exactly 1.

Under adapters the KL term's reference is the base with the adapters off (no second copy of
the model); otherwise the initial weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from segpack import loss as loss_lib
from train import data as data_lib
from train import sharding as sharding_lib
from train.data_sources import DataConfigError
from train.model import head_loss
from train.model import lora as lora_lib
from train.rl import prompts as prompts_lib
from train.rl import rewards as rewards_lib
from train.rl import rollouts as rollouts_lib
from train.rl import settings as settings_lib
from segpack.loss import policy as policy_loss

__all__ = ["RLObjective", "from_config"]

SUMS = ("tokens", "clipped_low", "clipped_high", "kl_sum", "ratio_sum", "loss_sum")


@dataclasses.dataclass(frozen=True)
class RLObjective:
  """The objective of `rl.loss` (the module docstring).

  Attributes:
    policy: the token loss (`segpack.loss.policy.PolicyLoss`, from `rl.*`).
    temperature: the sampling temperature the log-probs are taken at (1 for greedy choice).
    blocks: `head_loss.token_losses`' `block_size` and `vocab_block_size` (`loss.*`).
    source: the run's rollouts (bound by `make_data`, then `prepare`).
  """

  policy: policy_loss.PolicyLoss
  temperature: float = 1.0
  blocks: tuple[int, int] = (0, 0)
  source: Any = None

  def make_data(self, config: Any, *, mesh: Any, batch_size: int, process_index: int,
                process_count: int) -> tuple[data_lib.Data, rollouts_lib.Rollouts]:
    """The rollouts over `data.train`'s prompts; refuses what cannot be sampled or packed."""
    del mesh, process_index
    if process_count != 1:
      raise DataConfigError(f"rl.loss={config.rl.loss!r} runs in one process (the sampler "
                            f"runs on one host); got {process_count} processes")
    prompts, held = prompts_lib.split(config, prompts_lib.open_prompts(config, workdir=""))
    s = config.rl
    rewards = rewards_lib.parse_rewards(s.rewards, format_pattern=s.format_pattern,
                                        overlong_buffer=s.overlong_buffer)
    rewards_lib.check_fields(rewards, prompts.records, name=f"data.train={prompts.name!r}")
    _check_room(config, prompts)
    source = rollouts_lib.Rollouts(prompts=prompts, config=config, rewards=rewards,
                                   batch_size=batch_size, workdir="")
    description = (f"{prompts_lib.describe(prompts)}; {s.prompts_per_step} prompts x "
                   f"{s.num_generations} completions of up to {s.max_completion_length} tokens "
                   f"a round, groups packed whole ({'prompt once' if s.shared_prompt else 'prompt copied'}) "
                   f"into rows of {config.packing.seq_len}; rewards {[r.name for r in rewards]}")
    if held is not None:
      rewards_lib.check_fields(rewards, held.records, name=f"the held-out prompts {held.name!r}")
      description += f"; {len(held.ids)} held-out prompts"
    data = data_lib.Data(train=_Stream(source), eval=held, vocab_size=prompts.vocab_size,
                         train_rows_in_epoch0=batch_size, description=description,
                         tokenizer_fingerprint=prompts.tokenizer_fingerprint)
    return data, source

  def prepare(self, prepared: Any) -> tuple["RLObjective", str]:
    """Binds the rollouts to the live weights, the reference and the run's directory."""
    source = prepared.extra
    source.directory = f"{prepared.workdir}/{rollouts_lib.ROLLOUTS_DIR}"
    score = _scorer(prepared.graphdef, self.blocks, self.temperature)
    reference = _kept(prepared.reference_params()) if self.policy.needs_reference else None

    def scored(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
      batch = sharding_lib.global_batch(rows, prepared.mesh)
      logp, entropy = score(prepared.live_params(), batch)
      out = dict(rows, old_logp=np.asarray(logp))
      if entropy is not None:  # a metric only: the round takes it out before serving the rows
        out[rollouts_lib.ENTROPY] = np.asarray(entropy)
      if reference is not None:
        out["reference_logp"] = np.asarray(score(reference, batch)[0])
      return out

    source.bind(rollouts_lib.Bound(
        model=lambda: lora_lib.model_of(prepared.graphdef, prepared.live_params()),
        score=scored))
    line = ("reference: the initial weights (adapters off under LoRA), scored on each round's "
            "rows" if reference is not None else None)
    return dataclasses.replace(self, source=source), line

  def batch_sharding(self, mesh: Any) -> Any:
    return sharding_lib.batch_sharding(mesh)

  def normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
    return self.policy.normalizer(batch["labels"], batch["segment_ids"])

  def zeros(self) -> dict[str, jax.Array]:
    return {name: jnp.float32(0) for name in SUMS}

  def loss_and_sums(self, model: Any, batch: dict[str, jax.Array],
                    total: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(sum of w_t loss_t / total, metric sums)` of a (micro-)batch."""
    logp_BxS = -head_loss.token_losses(model, batch, block_size=self.blocks[0],
                                       vocab_block_size=self.blocks[1],
                                       temperature=self.temperature)
    t = self.policy.terms(
        logp_BxS, old_logp_BxS=batch["old_logp"], advantages_BxS=batch["advantages"],
        labels_BxS=batch["labels"], segment_ids_BxS=batch["segment_ids"],
        ref_logp_BxS=batch.get("reference_logp"))
    loss_sum = jnp.sum(t["loss"])
    sums = dict(tokens=jnp.sum(t["mask"]), clipped_low=jnp.sum(t["clipped_low"]),
                clipped_high=jnp.sum(t["clipped_high"]), kl_sum=jnp.sum(t["kl"]),
                ratio_sum=jnp.sum(t["ratio"] * t["mask"]), loss_sum=loss_sum)
    sums = jax.tree.map(jax.lax.stop_gradient, sums)
    return loss_sum / jnp.maximum(total, 1.0), sums

  def eval_sums(self, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    count = self.normalizer(batch)
    return dict(self.loss_and_sums(model, batch, count)[1], count=count)

  def evaluate(self, run: Any) -> dict[str, Any]:
    """The held-out prompts answered greedily and rewarded (`Rollouts.evaluate`)."""
    return self.source.evaluate(run.data.eval, limit=int(run.config.train.eval_batches) *
                                int(run.config.rl.prompts_per_step))

  def window_means(self, window: list[dict[str, Any]], counts: float) -> dict[str, Any]:
    """Per completion token: clip fractions, KL, mean ratio; and the last round's metrics."""
    tokens = max(sum(float(m["tokens"]) for m in window), 1.0)

    def mean(name):
      return sum(float(m[name]) for m in window) / tokens

    out = dict(clip_low=mean("clipped_low"), clip_high=mean("clipped_high"), kl=mean("kl_sum"),
               ratio=mean("ratio_sum"))
    out["clip_fraction"] = out["clip_low"] + out["clip_high"]
    out.update(self.source.metrics if self.source is not None else {})
    return out

  def describe(self, record: dict[str, Any], prefix: str = "") -> str:
    if prefix:
      accuracy = record.get("eval_accuracy")
      return (f" | reward {record['eval_reward']:.3f}"
              + ("" if accuracy is None else f", acc {accuracy:.1%}")
              + f" over {record['eval_prompts']} prompts (greedy)")
    if "reward" not in record:
      return ""
    accuracy = record.get("accuracy")
    return (f" | reward {record['reward']:.3f}"
            + ("" if accuracy is None else f", acc {accuracy:.1%}")
            + f", len {record['completion_length']:.0f}, clip {record['clip_fraction']:.1%}")


@dataclasses.dataclass
class _Stream:
  """`Data.train` of an RL run: its iterator is the rollouts."""

  source: rollouts_lib.Rollouts

  def iterator(self, *, read_options: Any = None) -> rollouts_lib.Rollouts:
    del read_options
    return self.source


def _scorer(graphdef: Any, blocks: tuple[int, int], temperature: float):
  """The jitted log-probs of rows under given parameters (old and reference log-probs), and
  with the full logits (`loss.block_size=0`) every slot's entropy at the same temperature (the
  blocked loss never holds a whole row of logits: no entropy then)."""

  @functools.partial(jax.jit)
  def score(params, batch):
    model = lora_lib.model_of(graphdef, params)
    if blocks[0]:
      return -head_loss.token_losses(model, batch, block_size=blocks[0],
                                     vocab_block_size=blocks[1], temperature=temperature), None
    logits_BxSxV = model.batch_logits(batch)
    if temperature != 1.0:
      logits_BxSxV = logits_BxSxV / temperature  # as head_loss.token_losses divides them
    logp_BxSxV = jax.nn.log_softmax(logits_BxSxV.astype(jnp.float32), axis=-1)
    entropy_BxS = -jnp.sum(jnp.exp(logp_BxSxV) * logp_BxSxV, axis=-1)
    return -loss_lib.token_cross_entropy(logits_BxSxV, batch["labels"]), entropy_BxS
  return score


def _kept(params: Any) -> Any:
  """The reference's parameters, copied where the train step donates them: the initial weights
  (a second copy, as any KL reference of full fine-tuning), or under adapters the adapters with
  B at zero over the frozen base (which no step donates: not copied)."""
  if isinstance(params, tuple):
    trained, frozen = params
    return jax.tree.map(jnp.copy, trained), frozen
  return jax.tree.map(jnp.copy, params)


def _check_room(config: Any, prompts: prompts_lib.Prompts) -> None:
  """Refuses a group that cannot fit a row at its longest."""
  s = config.rl
  longest = max(x.size for x in prompts.ids)
  need = (longest - 1 + s.num_generations * (1 + s.max_completion_length) if s.shared_prompt
          else s.num_generations * (longest + s.max_completion_length))
  if need > config.packing.seq_len:
    raise DataConfigError(
        f"a group of the longest prompt ({longest} tokens) and rl.num_generations="
        f"{s.num_generations} completions of rl.max_completion_length="
        f"{s.max_completion_length} needs {need} slots, more than packing.seq_len="
        f"{config.packing.seq_len}: raise packing.seq_len or lower rl.num_generations or "
        f"rl.max_completion_length")


def from_config(config: Any) -> RLObjective:
  return RLObjective(policy=settings_lib.policy_of(config),
                     temperature=float(config.rl.temperature) or 1.0,
                     blocks=(int(config.loss.block_size), int(config.loss.vocab_block_size)))

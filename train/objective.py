"""What a training mode decides, as one interface the step, the eval pass and the loop call.

An objective says, for its rows: which data the run reads (`make_data`), what it needs before
step 1 (`prepare`: the sources of a mixture, a preference loss's reference scores), how the
batch arrives on the mesh (`batch_sharding`), what a batch's loss is normalised by
(`normalizer`), the loss and the metric sums of a (micro-)batch (`zeros`, `loss_and_sums`), the
sums of a held-out batch (`eval_sums`), and how those sums are logged (`window_means`,
`describe`). The trainer (`train.steps`, `train.train`) never asks which objective it runs.

`TokenObjective` is the token loss of pretraining and SFT: cross-entropy over the trained
tokens (or per-document means, `loss.weighting="sequence"`), from the full logits or in blocks
(`loss.block_size`), with per-source sums for a mixture. `train.preference.objective`'s
`PreferenceObjective` is the other one. A new objective is one module implementing `Objective`,
passed to `train.train.train_and_evaluate(config, workdir, objective=...)`.

Example: a mixture of two sources, `TokenObjective(...).prepare(...)` binds their names; each
step's metrics then carry `source_loss_sum` and `source_tokens` (`[2]` each), and the train
record `loss/web`, `tokens/web`, `loss/code`, `tokens/code`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from segpack import loss as loss_lib
from train import data as data_lib
from train import sharding as sharding_lib
from train.model import head_loss


@dataclasses.dataclass(frozen=True)
class Prepared:
  """What `Objective.prepare` may use, before step 1 changes the weights.

  Attributes:
    config: the run's config.
    workdir: the run's directory (a reference's scores are kept there).
    data: the run's `train.data.Data`.
    extra: the second value of the objective's `make_data` (preference splits; None).
    graphdef: the decoder's graph (`nnx.split`).
    reference_params: the parameters of the model the run starts from, with adapters off
      (called only when needed).
    mesh: the run's mesh.
    resumed: whether the run resumes from a checkpoint.
    live_params: the parameters as they are now, as `train.model.lora.model_of` takes them
      (an objective that samples from the model it trains reads them between steps).
  """

  config: Any
  workdir: str
  data: Any
  extra: Any
  graphdef: Any
  reference_params: Callable[[], Any]
  mesh: Any
  resumed: bool
  live_params: Callable[[], Any] = lambda: None


class Objective(Protocol):
  """A training mode: its data, its preparation, its loss, its metrics (the module docstring)."""

  def make_data(self, config: Any, *, mesh: Any, batch_size: int, process_index: int,
                process_count: int) -> tuple[data_lib.Data, Any]:
    """`(the run's batches, what `prepare` needs of them or None)`."""

  def prepare(self, prepared: Prepared) -> tuple["Objective", str | None]:
    """`(the objective bound to the run, a line the run prints or None)`."""

  def batch_sharding(self, mesh: Any) -> Any:
    """The batch's sharding at the jit boundary (None: as the batch arrives)."""

  def normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
    """What the global batch's summed loss is divided by."""

  def zeros(self) -> dict[str, jax.Array]:
    """The metric sums of a batch with nothing in it (`loss_and_sums`'s second value)."""

  def loss_and_sums(self, model: Any, batch: dict[str, jax.Array],
                    total: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(summed loss / total, metric sums)` of a (micro-)batch; the sums carry no gradient."""

  def eval_sums(self, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A held-out batch's `loss_sum`, `count` and metric sums (each mean is a sum / count)."""

  def window_means(self, window: list[dict[str, Any]], counts: float) -> dict[str, Any]:
    """The train record's entries of the (fetched) step metrics since the last record."""

  def describe(self, record: dict[str, Any], prefix: str = "") -> str:
    """What the printed train (`prefix=""`) or eval (`"eval_"`) line adds for this objective."""


@dataclasses.dataclass(frozen=True)
class TokenObjective:
  """The token loss: cross-entropy over the trained tokens of the global batch.

  Attributes:
    weighting: "token" (every trained token alike) or "sequence" (per-document means).
    blocks: `train.model.head_loss.token_losses`'s `block_size` and `vocab_block_size`.
    source_names: a mixture's sources (bound by `prepare`); their sums are in the metrics.
  """

  weighting: str = "token"
  blocks: tuple[int, int] = (0, 0)
  source_names: tuple[str, ...] = ()

  def __post_init__(self):
    loss_lib.check_weighting(self.weighting, name="loss.weighting")

  @classmethod
  def from_config(cls, config: Any) -> "TokenObjective":
    return cls(weighting=config.loss.weighting,
               blocks=(int(config.loss.block_size), int(config.loss.vocab_block_size)))

  def make_data(self, config: Any, *, mesh: Any, batch_size: int, process_index: int,
                process_count: int) -> tuple[data_lib.Data, None]:
    return data_lib.make_data(config, num_ranks=sharding_lib.batch_partitions(mesh),
                              batch_size=batch_size, process_index=process_index,
                              process_count=process_count), None

  def prepare(self, prepared: Prepared) -> tuple["TokenObjective", None]:
    return dataclasses.replace(self, source_names=tuple(prepared.data.source_names)), None

  def batch_sharding(self, mesh: Any) -> Any:
    return sharding_lib.batch_sharding(mesh)

  def normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
    return loss_lib.loss_normalizer(batch["labels"], weighting=self.weighting,
                                    segment_ids_BxS=batch["segment_ids"])

  def zeros(self) -> dict[str, jax.Array]:
    n = len(self.source_names)
    return dict(source_loss_sum=jnp.zeros(n, jnp.float32),
                source_tokens=jnp.zeros(n, jnp.float32)) if n else {}

  def _token_losses(self, model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    return head_loss.token_losses(model, batch, block_size=self.blocks[0],
                                  vocab_block_size=self.blocks[1])

  def loss_and_sums(self, model: Any, batch: dict[str, jax.Array],
                    total: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    token_loss_BxS = self._token_losses(model, batch)
    loss_sum = loss_lib.token_loss_sum(token_loss_BxS, batch["labels"], weighting=self.weighting,
                                       segment_ids_BxS=batch["segment_ids"])[0]
    loss = loss_sum / jnp.maximum(jnp.asarray(total, jnp.float32), 1.0)
    if not self.source_names:
      return loss, {}
    sums = loss_lib.token_loss_by_source(
        jax.lax.stop_gradient(token_loss_BxS), batch["labels"], batch["segment_sources"],
        num_sources=len(self.source_names))
    return loss, dict(source_loss_sum=sums[0], source_tokens=sums[1])

  def eval_sums(self, model: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    loss_sum, count = loss_lib.token_loss_sum(self._token_losses(model, batch), batch["labels"],
                                              weighting=self.weighting,
                                              segment_ids_BxS=batch["segment_ids"])
    return dict(loss_sum=loss_sum, count=count)

  def window_means(self, window: list[dict[str, Any]], counts: float) -> dict[str, Any]:
    """A mixture's loss and trained tokens of every source over the window."""
    out: dict[str, Any] = {}
    for n, name in enumerate(self.source_names):
      tokens = sum(float(m["source_tokens"][n]) for m in window)
      out[f"tokens/{name}"] = int(tokens)
      out[f"loss/{name}"] = (sum(float(m["source_loss_sum"][n]) for m in window) / tokens
                             if tokens else None)
    return out

  def describe(self, record: dict[str, Any], prefix: str = "") -> str:
    return ""

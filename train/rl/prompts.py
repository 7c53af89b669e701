"""An RL run's prompts: `data.train`, a dataset of `segpack tokenize --format prompts`.

Every prompt comes as the model sees it: its ids with the BOS first when the run adds one
(`data.add_bos`, unless its chat template wrote the BOS itself), its record (the fields the
rewards read) and its text (for the rewards and the rollouts' files). Round `r` draws prompts
`r * P .. (r + 1) * P - 1` of the prompt stream: epoch after epoch, each epoch a seeded
permutation of the prompts, so a round's prompts depend on the seed and `r` alone (a resumed
run draws what an uninterrupted one would).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from segpack.data import sources as sources_lib
from segpack.text.chat import prompts as prompts_lib
from train import data_sources
from train.data_sources import DataConfigError
from train.runs import tokenizer as run_tokenizer


@dataclasses.dataclass
class Prompts:
  """The prompts of a run.

  Attributes:
    ids: every prompt's ids as the model sees them.
    records: every prompt's record.
    texts: every prompt's text (the ids decoded, without the BOS).
    name: `data.train`'s value, for messages.
    vocab_size, tokenizer_fingerprint: the dataset's.
    stop_ids: the ids that end a completion (EOS, a chat template's end of turn).
    detokenize: ids to text.
  """

  ids: list[np.ndarray]
  records: list[dict[str, Any]]
  texts: list[str]
  name: str
  vocab_size: int
  tokenizer_fingerprint: str
  stop_ids: tuple[int, ...]
  detokenize: Any

  def round_prompts(self, round_index: int, per_round: int, *, seed: int) -> list[int]:
    """The prompt indices of round `round_index` (the module docstring)."""
    n = len(self.ids)
    orders: dict[int, np.ndarray] = {}  # each epoch's permutation, drawn once per round
    out = []
    for position in range(round_index * per_round, (round_index + 1) * per_round):
      epoch, at = divmod(position, n)
      if epoch not in orders:
        orders[epoch] = np.random.default_rng([int(seed), 7919, epoch]).permutation(n)
      out.append(int(orders[epoch][at]))
    return out

  def subset(self, indices: Any) -> "Prompts":
    """The prompts at `indices`, in that order."""
    keep = [int(i) for i in indices]
    return dataclasses.replace(self, ids=[self.ids[i] for i in keep],
                               records=[self.records[i] for i in keep],
                               texts=[self.texts[i] for i in keep])


def split(config: Any, prompts: Prompts) -> tuple[Prompts, Prompts | None]:
  """`(training prompts, held-out prompts or None)`: `data.eval`'s prompts, or `data.eval_share`
  of `data.train`'s (a seeded choice of whole prompts, at least one when the share is > 0)."""
  if config.data.eval is not None:
    held = open_prompts(config, workdir="", key="data.eval")
    if held.tokenizer_fingerprint != prompts.tokenizer_fingerprint:
      raise DataConfigError(f"data.train={prompts.name!r} and data.eval={held.name!r} were "
                            f"tokenized differently; tokenize both with one tokenizer")
    return prompts, held
  share = float(config.data.eval_share)
  if share == 0 or len(prompts.ids) < 2:
    return prompts, None
  order = np.random.default_rng([int(config.data.seed), 104729]).permutation(len(prompts.ids))
  n = max(1, int(round(share * len(order))))
  return prompts.subset(np.sort(order[n:])), prompts.subset(np.sort(order[:n]))


def _not_prompts(config: Any, why: str, key: str = "data.train") -> DataConfigError:
  return DataConfigError(
      f"rl.loss={config.rl.loss!r} samples completions of the prompts of one dataset written by "
      f"`segpack tokenize --format prompts`; {key}={config.data[key.split('.')[1]]!r} {why}")


def open_prompts(config: Any, workdir: str, *, key: str = "data.train") -> Prompts:
  """`key`'s prompts (`data.train` or `data.eval`), refused by name when not a prompts dataset."""
  path = config.data[key.split(".")[1]]
  if path is None or "=" in str(path):
    raise _not_prompts(config, "is not one dataset", key)
  source = data_sources.open_dataset(key, path)
  record = sources_lib.dataset_record(source)
  counts = None if record is None else record.extra.get(prompts_lib.PROMPTS_KEY)
  if not counts:
    raise _not_prompts(config, "is not one (its manifest has no metadata.prompts)", key)
  try:
    records = prompts_lib.read_records(path)
  except (OSError, ValueError) as e:
    raise _not_prompts(config, f"has no readable {prompts_lib.RECORDS_NAME} ({e})", key) from e
  if len(records) != len(source):
    raise _not_prompts(config, f"holds {len(source)} prompts but {len(records)} records in "
                               f"{prompts_lib.RECORDS_NAME}", key)
  tokenizer = run_tokenizer.tokenizer_for_run(config)
  bos = tokenizer.bos_id if config.data.add_bos and not sources_lib.template_writes_special_tokens(
      source, fn=f"{key}={path!r}") else None
  first = [] if bos is None or bos < 0 else [int(bos)]
  ids = [np.asarray(first + [int(t) for t in source[i]], np.int64) for i in range(len(source))]
  stops = {int(tokenizer.eos_id)} if tokenizer.eos_id is not None and tokenizer.eos_id >= 0 else set()
  if run_tokenizer.is_chat(config):
    renderer = run_tokenizer.chat_renderer(config, workdir)
    stops.update(int(i) for i in renderer.stop_ids)
  detokenize = tokenizer.decode
  return Prompts(ids=ids, records=records,
                 texts=[detokenize([int(t) for t in x[len(first):]]) for x in ids],
                 name=str(path), vocab_size=int(source.vocab_size),
                 tokenizer_fingerprint=str(source.tokenizer_fingerprint),
                 stop_ids=tuple(sorted(stops)), detokenize=detokenize)


def describe(prompts: Prompts) -> str:
  """The data line of the run's log."""
  lengths = np.asarray([x.size for x in prompts.ids])
  fields = sorted(set.intersection(*(set(r) for r in prompts.records)) - {"prompt"})
  return (f"{prompts.name}: {len(prompts.ids):,} prompts (median {int(np.median(lengths))} "
          f"tokens, max {int(lengths.max())}), fields {fields}")


def record_line(record: dict[str, Any]) -> str:
  """A record as one JSON line (for the rollouts' files)."""
  return json.dumps(record, ensure_ascii=False, default=str)


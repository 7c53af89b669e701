r"""Scores a preference dataset with a model: `python -m train.preference.score`.

  python -m train.preference.score --model MODEL_DIR --data PAIRS --output SCORES       # a Hugging Face model
  python -m train.preference.score --workdir RUN --data PAIRS --output SCORES          # a run's checkpoint
  python -m train.preference.score ... --per-token                                     # token log-probs too

Every pair of PAIRS (`segpack tokenize --format preference`) is scored once by one packed pass
(`train.preference.scoring.score_pairs`): the chosen and rejected completions' summed log-probs
and their trained tokens. SCORES then holds `scores.json` and `dataset.npy` (float64 `[pairs, 4]`),
the format of a run's `WORKDIR/reference`, so a DPO run can take another model as its reference
(`--config.preference.reference=SCORES`); with `--per-token`, `tokens.npz` holds every
completion's token log-probs (`chosen`, `rejected`: flat float32 arrays; `chosen_offsets`,
`rejected_offsets`: where pair k's run starts, `pairs + 1` entries).
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from configs import packed
from segpack import errors
from segpack import files
from segpack import shards
from segpack.data import pairs as pairs_lib
from segpack.data.options import SpecialTokens
from segpack.errors import UserError
from train.model import decoder as model_lib
from train import sharding as sharding_lib
from train.hf import config as hf_config
from train.hf import init_from as hf_init
from train.hf import weights as hf_weights
from train.preference import reference as reference_lib
from train.preference import scoring
from train.runs import loaded as loaded_run

PROG = "python -m train.preference.score"


class ScoreError(UserError, ValueError):
  """A dataset, model or output that cannot be scored (one line, exit code 2)."""


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  model = p.add_mutually_exclusive_group(required=True)
  model.add_argument("--model", help="a Hugging Face model directory (config.json, safetensors)")
  model.add_argument("--workdir", help="a run directory: its newest intact checkpoint")
  p.add_argument("--data", required=True, help="a preference dataset (segpack tokenize "
                                               "--format preference)")
  p.add_argument("--output", required=True, help="the scores directory to write")
  p.add_argument("--seq-len", type=errors.at_least(2), default=None,
                 help="slots per row (default: the run's packing.seq_len, or 4096)")
  p.add_argument("--batch-size", type=errors.at_least(1), default=8, help="rows per forward")
  p.add_argument("--no-bos", action="store_true",
                 help="add no BOS before text pairs (default: the run's data.add_bos, or BOS)")
  p.add_argument("--per-token", action="store_true", help="also write tokens.npz")
  p.add_argument("--shared-prefix", action="store_true",
                 help="store each prompt once per pair, the answers as branches after it")
  p.add_argument("--overwrite", action="store_true", help="replace scores already in --output")
  return p


def _single_mesh():
  return sharding_lib.make_mesh(data=1, devices=jax.devices()[:1])


def _hf_model(model_dir: str, data: shards.ShardSource) -> tuple[Any, Any, Any]:
  """`(config, graphdef, params)` of a Hugging Face directory, checked against the data."""
  config = packed.base_config()
  config.model.init_from = model_dir
  hf_config.adopt(config)
  hf_init.check_tokenizer(model_dir, data_fingerprint=data.tokenizer_fingerprint,
                          data_name=f"--data {data.path}")
  vocab = config.model.vocab_size or int(data.vocab_size)
  abstract = model_lib.abstract(config, vocab_size=vocab)
  graphdef, abstract_params = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf_weights.load_params(model_dir, abstract_params,
                                  jax.tree.map(lambda _: device, abstract_params), config.model)
  return config, graphdef, params


def _model(args: argparse.Namespace, data: shards.ShardSource) -> tuple[Any, Any, Any]:
  if args.model is not None:
    return _hf_model(args.model, data)
  config, model, _ = loaded_run.load_run(args.workdir)
  graphdef, params = nnx.split(model)
  return config, graphdef, params


def _token_file(runs: dict[int, list[np.ndarray]], num_pairs: int) -> bytes:
  out = {}
  for i, which in enumerate(("chosen", "rejected")):
    parts = [runs.get(k, [np.zeros(0), np.zeros(0)])[i] for k in range(num_pairs)]
    out[which] = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    out[f"{which}_offsets"] = np.concatenate([[0], np.cumsum([p.size for p in parts])])
  buffer = io.BytesIO()
  np.savez(buffer, **out)
  return buffer.getvalue()


def score(args: argparse.Namespace) -> dict[str, Any]:
  """Runs the command; returns its summary."""
  output = Path(args.output)
  if (output / reference_lib.MANIFEST).exists() and not args.overwrite:
    raise ScoreError(f"--output {output} already holds scores ({reference_lib.MANIFEST}); "
                     f"pass --overwrite to replace them")
  try:
    data = shards.ShardSource(args.data)
  except (OSError, shards.ShardFormatError) as e:
    raise ScoreError(f"--data {args.data!r} could not be opened as a dataset: {e}") from e
  config, graphdef, params = _model(args, data)
  seq_len = args.seq_len or (config.packing.seq_len if args.workdir else 4096)
  special = SpecialTokens(add_bos=config.data.add_bos and not args.no_bos,
                          add_eos=config.data.add_eos)
  try:
    rows = pairs_lib.pack_pairs(data, seq_len=seq_len, shuffle=False, num_epochs=1,
                                special_tokens=special, shared_prefix=args.shared_prefix)
  except (pairs_lib.NotPreferenceDataError, ValueError) as e:
    raise ScoreError(f"--data {args.data}: {errors.one_line(e)}") from e
  start = time.perf_counter()
  table, runs = scoring.score_pairs(
      step=scoring.make_score_step(graphdef, per_token=args.per_token), params=params,
      rows=rows, mesh=_single_mesh(), batch_size=args.batch_size, num_pairs=len(data) // 2,
      per_token=args.per_token)
  seconds = time.perf_counter() - start
  with files.file_lock(output.with_name(output.name + ".lock"), wait=False, remove=True):
    if args.per_token:
      output.mkdir(parents=True, exist_ok=True)
      files.atomic_write_bytes(output / "tokens.npz", _token_file(runs, len(table)))
    reference_lib.save_scores(output, fingerprint=reference_lib.model_fingerprint(config),
                              tables={"dataset": table}, data={"dataset": str(data.fingerprint)})
  return dict(pairs=len(table), seconds=seconds, output=str(output),
              chosen_logp=float(np.nanmean(table[:, 0])),
              rejected_logp=float(np.nanmean(table[:, 1])))


@errors.command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
  """Parses the flags and scores; a user's mistake is one line and exit code 2."""
  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  summary = score(args)
  print(f"{PROG}: {summary['pairs']:,} pairs scored in {summary['seconds']:.1f} s into "
        f"{summary['output']} (mean summed log-prob: chosen {summary['chosen_logp']:.3f}, "
        f"rejected {summary['rejected_logp']:.3f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

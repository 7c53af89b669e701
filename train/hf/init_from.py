"""What the trainer does with `model.init_from`: checks, the initial parameters, the source files.

Algorithm (`train.setup.setup`, before the first step of a run from scratch):
  1. `check_adopted`: the config's model keys are the checkpoint's (`hf_config.adopt` ran; the
     command line does it) and rows are no longer than the model's sliding window.
  2. `check_tokenizer`: the training data was tokenized with the model directory's
     `tokenizer.json` (equal fingerprints, `segpack tokenize --tokenizer hf:DIR`). The embedding
     may have more rows than the tokenizer has tokens (`model.vocab_size` >= the data's).
  3. `initial_state`: the weights, placed with the state's shardings (`hf_weights.load_params`),
     and a fresh optimizer state for them.
  4. `keep_source_files`: the directory's small files (config.json, generation_config.json,
     tokenizer files, chat template) are copied to `WORKDIR/hf_source` once, atomically, so that
     export never depends on a path outside the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable

import jax

from segpack import errors
from segpack.text.tokenizers import hf as hf_tokenizer
from train.hf import config as hf_config
from train.hf import weights as hf_weights

SOURCE_DIR = "hf_source"
# The files of a model directory that describe it besides its weights (copied when present).
SOURCE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def check_adopted(config: Any) -> None:
  """Step 1: refuses a config whose model keys differ from `model.init_from`'s config.json."""
  model_dir = config.model.init_from
  where = os.path.join(model_dir, hf_config.CONFIG_NAME)
  arch = hf_config.architecture(hf_config.read_config(model_dir), where=where)
  diffs = hf_config.differences(config.model, arch)
  if diffs:
    key, ours, theirs = diffs[0]
    raise hf_config.HfModelError(
        f"model.{key}={ours!r} differs from {where} ({theirs!r}): call "
        f"train.hf.config.adopt(config) before train_and_evaluate (python -m train.main does)")
  hf_config.check_window(config.model, config.packing.seq_len)


def check_tokenizer(model_dir: str, *, data_fingerprint: str | None, data_name: str) -> None:
  """Step 2: the data's tokenizer must be the model directory's (one line naming both)."""
  try:
    tokenizer = hf_tokenizer.HfTokenizer(model_dir)
  except (OSError, ValueError, ImportError) as e:
    raise hf_config.HfModelError(f"model.init_from={model_dir!r}: its tokenizer cannot be "
                                 f"read ({errors.one_line(e)})") from e
  if data_fingerprint is None:
    raise hf_config.HfModelError(
        f"model.init_from={model_dir!r} needs data tokenized with the model's tokenizer, and "
        f"{data_name} is not (segpack's built-in corpora have their own SentencePiece model): "
        f"segpack tokenize --tokenizer hf:{model_dir} ..., then --config.data.train=DIR")
  if data_fingerprint != tokenizer.fingerprint:
    raise hf_config.HfModelError(
        f"{data_name} was tokenized with tokenizer {data_fingerprint}, but model.init_from="
        f"{model_dir!r} has tokenizer {tokenizer.fingerprint} ({tokenizer.model_file}); "
        f"tokenize the data with --tokenizer hf:{model_dir}")


def initial_state(config: Any, abstract_params: Any, state_shardings: dict[str, Any],
                  init_opt_state: Callable[[Any], Any]) -> dict[str, Any]:
  """Step 3: `{"params", "opt_state", "step"}` with the checkpoint's weights, on the mesh."""
  params = hf_weights.load_params(config.model.init_from, abstract_params,
                                  state_shardings["params"], config.model)

  def fresh(params):
    return dict(params=params, opt_state=init_opt_state(params), step=jax.numpy.int32(0))

  return jax.jit(fresh, out_shardings=state_shardings)(params)


def keep_source_files(model_dir: str, workdir: str) -> str:
  """Step 4: copies the model directory's small files to `workdir/hf_source`.

  Called as a run starts from `model_dir` with no checkpoint: a copy already there belongs to
  an earlier start that saved nothing (perhaps from another model) and is replaced, so the
  export never ships another model's tokenizer or chat template.
  """
  target = os.path.join(workdir, SOURCE_DIR)
  staging = tempfile.mkdtemp(dir=workdir, prefix=f".{SOURCE_DIR}-")
  stale = None
  try:
    for name in SOURCE_FILES:
      path = os.path.join(model_dir, name)
      if os.path.isfile(path):
        shutil.copyfile(path, os.path.join(staging, name))
    if os.path.isdir(target):
      stale = tempfile.mkdtemp(dir=workdir, prefix=f".{SOURCE_DIR}-stale-")
      os.replace(target, os.path.join(stale, SOURCE_DIR))
    os.replace(staging, target)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
    if stale is not None:
      shutil.rmtree(stale, ignore_errors=True)
  return target

"""The tokenizer (and chat renderer) of a run, found from its saved config.

`data.train` may be one dataset, a mixture (`name=path:weight,...`, the rule of
`segpack.data.mixture.parse_data`) or a URL (read from its staged local copy, as the trainer
read it); the tokenizer is the copy inside the dataset that its manifest names, checked against
the manifest's fingerprint. The built-in corpora's tokenizers come from the cache.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from segpack import remote_files
from segpack import shards
from segpack.data.mixture import parse_data
from segpack.data.options import PipelineConfigError
from segpack.shards import staging
from segpack.shards.format import read_manifest
from segpack.text import chat
from segpack.text import chat_corpus
from segpack.text import corpus
from segpack.text import hf_chat
from segpack.text import tokenizer_spec
from train import data as data_lib
from train.hf import init_from as hf_init
from train.runs.errors import NoTokenizerError, RunError

# `metadata.tokenizer.type` of a `segpack tokenize` manifest -> the kind of a tokenizer spec.
MANIFEST_TOKENIZER_KINDS = {"sentencepiece": "spm", "hf": "hf"}


def _dataset_tokenizer(dataset_dir: str) -> tokenizer_spec.Tokenizer:
  """The tokenizer recorded in a `segpack tokenize` dataset's manifest (`metadata.tokenizer`)."""
  path = os.path.join(dataset_dir, shards.MANIFEST_NAME)
  try:
    described = read_manifest(path).get("metadata", {}).get("tokenizer") or {}
  except (OSError, ValueError, AttributeError) as e:
    raise RunError(f"data.train={dataset_dir!r}: cannot read {path}: {e}") from e
  kind = MANIFEST_TOKENIZER_KINDS.get(described.get("type"))
  if kind is None or not described.get("model_file"):
    raise NoTokenizerError(
        f"data.train={dataset_dir!r}: {path} names no tokenizer this can load (metadata."
        f"tokenizer type {described.get('type')!r}, model_file {described.get('model_file')!r};"
        f" types: {sorted(MANIFEST_TOKENIZER_KINDS)})")
  model_file = os.path.abspath(os.path.join(dataset_dir, described["model_file"]))
  try:
    tokenizer = tokenizer_spec.from_spec(f"{kind}:{model_file}")
  except (OSError, ValueError, ImportError) as e:
    raise RunError(f"data.train={dataset_dir!r}: its tokenizer {model_file}: {e}") from e
  want = described.get("fingerprint")
  if want is not None and tokenizer.fingerprint != want:
    raise RunError(
        f"data.train={dataset_dir!r}: its tokenizer {model_file} is not the one the dataset was "
        f"tokenized with (fingerprint {tokenizer.fingerprint}, {path} says {want}): damaged or "
        f"replaced")
  return tokenizer


def _local_copy(path: str, *, cache_dir: str | None, stage: bool = True) -> str | None:
  """`path`, or for a URL the local copy the trainer read (staged now if it is gone; None then
  when `stage` is False)."""
  if not remote_files.is_url(path):
    return path
  folder = staging.staged_dir(url=path, cache_dir=cache_dir)
  if (folder / shards.MANIFEST_NAME).is_file():
    return str(folder)
  if not stage:
    return None
  try:
    return str(staging.stage_dataset(url=path, cache_dir=cache_dir, progress=False).path)
  except (OSError, shards.ShardFormatError) as e:
    raise RunError(f"data.train={path!r}: cannot stage the run's dataset to read its "
                      f"tokenizer: {e}") from e


def dataset_dirs(config: ml_collections.ConfigDict, *, stage: bool = True) -> list[str]:
  """The local directories of `data.train`: one dataset, every source of a mixture (the rule of
  `segpack.data.mixture.parse_data`), URLs as their staged copies (staged now if gone, unless
  `stage` is False: such a URL is then left out); [] without `data.train`."""
  spec = config.data.get("train")  # absent from older configs
  if not spec:
    return []
  try:
    mixture = parse_data(str(spec))
  except PipelineConfigError as e:
    raise RunError(f"data.train={spec!r}: {e}") from e
  paths = [str(spec)] if mixture is None else [str(m.source) for m in mixture.sources]
  local = [_local_copy(p, cache_dir=None, stage=stage) for p in paths]
  return [p for p in local if p is not None]


def tokenizer_for_run(config: ml_collections.ConfigDict) -> tokenizer_spec.Tokenizer:
  """The tokenizer of the run that `config` describes (the built-in corpora's are cached).

  Datasets in `data.train` (written by `segpack tokenize`) take precedence over `data.source`:
  each one's manifest names its tokenizer copy; the sources of a mixture must agree.

  Raises:
    NoTokenizerError: `data.source="synthetic"` (random ids, no text).
    RunError: a dataset's manifest names no loadable tokenizer, or a mixture's sources were
      tokenized differently.
  """
  dirs = dataset_dirs(config)
  if dirs:
    tokenizers = [_dataset_tokenizer(d) for d in dirs]
    differ = {t.fingerprint for t in tokenizers}
    if len(differ) > 1:
      raise RunError(f"data.train={config.data.train!r}: the sources were tokenized with "
                        f"different tokenizers ({sorted(differ)}); which one the model reads "
                        f"is unknown")
    return tokenizers[0]
  source, size, cache_dir = config.data.source, config.data.size, config.data.cache_dir
  if source == "builtin":
    return tokenizer_spec.from_spec(
        "spm:" + str(corpus.ensure_builtin(size=size, cache_dir=cache_dir).spm_model))
  if source == "builtin_chat":
    return chat_corpus.chat_tokenizer(size=size, cache_dir=cache_dir)
  if source == "synthetic":
    raise NoTokenizerError(f"data.source={source!r} has no tokenizer (random token ids)")
  raise RunError(f"data.source={source!r} is not a source with a tokenizer")


def special_ids(config: ml_collections.ConfigDict,
                tokenizer: tokenizer_spec.Tokenizer | None) -> tuple[int | None, int | None]:
  """`(bos_id, eos_id)` as the run's documents carried them (None where `data.add_bos` /
  `data.add_eos` is off or the tokenizer has none)."""
  dirs = dataset_dirs(config)
  if tokenizer is None and dirs:  # a dataset without a tokenizer file: its manifest's ids
    described = read_manifest(os.path.join(dirs[0], shards.MANIFEST_NAME)).get("metadata", {})
    bos, eos = (described.get("tokenizer") or {}).get("bos_id"), (
        described.get("tokenizer") or {}).get("eos_id")
  elif tokenizer is None:
    bos, eos = data_lib.SYNTHETIC_BOS, data_lib.SYNTHETIC_EOS
  else:
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
  bos = bos if config.data.add_bos and bos is not None and bos >= 0 else None
  eos = eos if config.data.add_eos and eos is not None and eos >= 0 else None
  return bos, eos


def has_template(directory: str) -> bool:
  """Whether a Hugging Face directory holds a chat template (its own file or in the config)."""
  if os.path.isfile(os.path.join(directory, "chat_template.jinja")):
    return True
  try:
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
      return bool(json.load(f).get("chat_template"))
  except (OSError, ValueError, AttributeError):
    return False


def data_chat_renderer(config: ml_collections.ConfigDict, *, stage: bool = True) -> Any:
  """The chat template the run's data was rendered with, None for plain-text data: a chat
  dataset's (`segpack.text.hf_chat.for_dataset`; the first chat source of a mixture), or the
  built-in chat corpus's (`segpack.text.chat.ChatEncoder`). It has `prompt_ids` and `stop_ids`.
  `stage=False` reads only local copies (a URL dataset not staged here is not fetched)."""
  if config.data.get("train"):
    for directory in dataset_dirs(config, stage=stage):
      try:
        renderer = hf_chat.for_dataset(directory)
      except ValueError as e:
        raise RunError(f"data.train={config.data.train!r}: {e}") from e
      if renderer is not None:
        return renderer
    return None
  if config.data.source == "builtin_chat":
    return chat.ChatEncoder(tokenizer_for_run(config))
  return None


def chat_renderer(config: ml_collections.ConfigDict, workdir: str) -> Any:
  """The run's chat template: its data's (`data_chat_renderer`), else an imported model's own
  template (kept in the run's `hf_source`); None when there is neither."""
  renderer = data_chat_renderer(config)
  if renderer is not None:
    return renderer
  source = os.path.join(workdir, hf_init.SOURCE_DIR)  # an imported model's own files
  if config.model.get("init_from") and has_template(source):
    return hf_chat.HfChatTemplate(source)
  return None

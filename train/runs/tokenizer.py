"""The tokenizer and chat template of a run, found from its saved config.

`data.train` may be one dataset, a mixture (`name=path:weight,...`, the rule of
`segpack.data.mixture.parse_data`) or a URL (read from its staged local copy, as the trainer
read it); the tokenizer is the copy inside the dataset that its manifest's record names
(`segpack.shards.record.DatasetRecord`), checked against the record's fingerprint. The built-in
corpora's tokenizers come from the cache.

`chat_renderer` is the one answer to "which chat template does this run's model speak", for
`train.sample --chat` and `train.export` alike: the template its chat data was rendered with
(every chat source of a mixture must have been rendered alike), else an imported model's own.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
from absl import logging

from segpack import errors
from segpack import remote_files
from segpack import shards
from segpack.data.mixture import parse_data
from segpack.data.options import PipelineConfigError
from segpack.shards import staging
from segpack.shards.format import read_manifest
from segpack.shards.record import ChatRecord, DatasetRecord, TokenizerRecord
from segpack.text import chat
from segpack.text.chat import corpus as chat_corpus
from segpack.text import corpus
from segpack.text.chat import hf_chat
from segpack.text.tokenizers import spec as tokenizer_spec
from train import data_sources as data_sources
from train.hf import init_from as hf_init
from train.runs.errors import NoTokenizerError, RunError

# `metadata.tokenizer.type` of a `segpack tokenize` manifest -> the kind of a tokenizer spec.
MANIFEST_TOKENIZER_KINDS = {"sentencepiece": "spm", "hf": "hf"}


def _dataset_record(dataset_dir: str) -> DatasetRecord:
  """The record of a `segpack tokenize` dataset's manifest (its tokenizer, its chat template)."""
  path = os.path.join(dataset_dir, shards.MANIFEST_NAME)
  try:
    return DatasetRecord.from_manifest(read_manifest(path), where=path)
  except (OSError, ValueError) as e:
    raise RunError(f"data.train={dataset_dir!r}: cannot read {path}: {e}") from e


def _dataset_tokenizer(dataset_dir: str) -> tokenizer_spec.Tokenizer:
  """The tokenizer recorded in a `segpack tokenize` dataset's manifest (`metadata.tokenizer`)."""
  path = os.path.join(dataset_dir, shards.MANIFEST_NAME)
  described = _dataset_record(dataset_dir).tokenizer or TokenizerRecord()
  kind = MANIFEST_TOKENIZER_KINDS.get(described.type)
  if kind is None or not described.model_file:
    raise NoTokenizerError(
        f"data.train={dataset_dir!r}: {path} names no tokenizer this can load (metadata."
        f"tokenizer type {described.type!r}, model_file {described.model_file!r};"
        f" types: {sorted(MANIFEST_TOKENIZER_KINDS)})")
  model_file = os.path.abspath(os.path.join(dataset_dir, described.model_file))
  try:
    tokenizer = tokenizer_spec.from_spec(f"{kind}:{model_file}")
  except (OSError, ValueError, ImportError) as e:
    raise RunError(f"data.train={dataset_dir!r}: its tokenizer {model_file}: {e}") from e
  want = described.fingerprint
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
    logging.warning("data.train source %s is a URL not staged on this machine: its manifest is "
                    "not read (a chat template it records is left out)", path)
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
  spec = config.data.train
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
  if tokenizer is None and dirs:  # a dataset without a tokenizer file: its record's ids
    record = _dataset_record(dirs[0])
    bos, eos = record.special_id("bos_id"), record.special_id("eos_id")
  elif tokenizer is None:
    bos, eos = data_sources.SYNTHETIC_BOS, data_sources.SYNTHETIC_EOS
  else:
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
  bos = bos if config.data.add_bos and bos is not None and bos >= 0 else None
  eos = eos if config.data.add_eos and eos is not None and eos >= 0 else None
  return bos, eos


def _chat_part(record: DatasetRecord) -> ChatRecord | None:
  """The record's chat rendering; None for plain text (no `metadata.chat`, or an empty one)."""
  return record.chat if record.chat is not None and record.chat.to_dict() else None


def is_chat(config: ml_collections.ConfigDict) -> bool:
  """Whether the run trained on conversations: the built-in chat corpus, or a dataset of
  `data.train` written with a chat template (what `train.sample --chat` needs)."""
  if config.data.source == "builtin_chat":
    return True
  try:
    return any(_chat_part(_dataset_record(d)) is not None
               for d in dataset_dirs(config, stage=False))
  except (RunError, OSError, ValueError):
    return False


def _rendered(described: ChatRecord) -> str:
  """How a dataset was rendered, in a few words (`_dataset_chat_renderer`'s refusal)."""
  if described.own_template:
    return (f"its tokenizer's own template {described.template_file} "
            f"({described.template_text_sha256 or described.template_sha256})")
  fields = dict(described.template or {})
  try:
    default = chat.ChatTemplate(**fields) == chat.DEFAULT_TEMPLATE
  except (TypeError, ValueError):  # not a template: named by its fields
    default = False
  return "segpack's template" if default else f"segpack's template {fields}"


def _dataset_chat_renderer(config: ml_collections.ConfigDict, dirs: list[str]) -> Any:
  """The renderer of the chat sources among `dirs` (None: none is chat); every one must have
  been rendered alike (`ChatRecord.rendering`: the same template, whatever its `train_on`)."""
  chats = [(d, found) for d in dirs if (found := _chat_part(_dataset_record(d))) is not None]
  if not chats:
    return None
  if len({described.rendering for _, described in chats}) > 1:
    each = "; ".join(f"{d}: {_rendered(described)}" for d, described in chats)
    raise RunError(f"data.train={config.data.train!r}: its chat sources were rendered with "
                   f"different chat templates ({each}); a model speaks one")
  try:
    return hf_chat.for_dataset(chats[0][0])
  except ValueError as e:
    raise RunError(f"data.train={config.data.train!r}: {e}") from e


def chat_renderer(config: ml_collections.ConfigDict, workdir: str, *,
                  stage: bool = True) -> Any:
  """The run's chat template, for sampling (`train.sample --chat`) and export alike; None when
  it has none.

  In order: the template its data was rendered with, a chat dataset's
  (`segpack.text.chat.hf_chat.for_dataset`: segpack's template, or the tokenizer's own) or the
  built-in chat corpus's (`segpack.text.chat.ChatEncoder`); else an imported model's own
  template (`WORKDIR/hf_source` holding one, `segpack.text.chat.hf_chat.has_template`). The result
  has `prompt_ids` and `stop_ids`.

  Args:
    config: the run's saved config.
    workdir: the run's directory (its `hf_source`).
    stage: False reads only local copies: a URL dataset not staged here is left out, not
      fetched (export).

  Raises:
    RunError: the chat sources of a mixture were rendered with different templates (naming
      `data.train` and each source's), or a dataset's renderer cannot be loaded.
  """
  if config.data.train:
    renderer = _dataset_chat_renderer(config, dataset_dirs(config, stage=stage))
  elif config.data.source == "builtin_chat":
    renderer = chat.ChatEncoder(tokenizer_for_run(config))
  else:
    renderer = None
  if renderer is not None:
    return renderer
  source = os.path.join(workdir, hf_init.SOURCE_DIR)  # an imported model's own files
  if not config.model.init_from or not hf_chat.has_template(source):
    return None
  try:
    return hf_chat.HfChatTemplate(source)
  except (OSError, ValueError) as e:
    raise RunError(f"{source}: the imported model's chat template cannot be loaded: "
                   f"{errors.one_line(e)}") from e

r"""Decodes continuations from a run's newest intact checkpoint: `python -m train.sample`.

  python -m train.sample --workdir runs/packed_smoke --prompt "def "               # greedy
  python -m train.sample --workdir runs/packed --prompt "def " --top_k 40 --num_samples 3
  python -m train.sample --workdir runs/synthetic --prompt_ids 5,6,7               # prints ids

Correct before fast: there is no KV cache, so every new token recomputes the whole forward pass
over the row (O(n^2) attention per token). The row is the one the trainer would build for the
prompt as one document: `[BOS] + prompt`, segment id 1, positions 0..n-1, padded with segment id 0
to a power-of-two length so `jax.jit` compiles once per length bucket, not once per token. The
model is causal and segment-masked, so the padding changes no logit of the document: the logits
used are those of the training forward pass on the unpadded row (tests/test_sample.py checks it).
Attention runs on the XLA backend whatever the run trained with (the same math, on any platform).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags, logging
from flax import nnx

from segpack import shards
from segpack.shards.format import read_manifest
from segpack.text import chat_corpus
from segpack.text import corpus
from segpack.text import tokenizer_spec
from train import checkpoint_digest as digest_lib
from train import data as data_lib
from train import model as model_lib

# `metadata.tokenizer.type` of a `segpack tokenize` manifest -> the kind of a tokenizer spec.
MANIFEST_TOKENIZER_KINDS = {"sentencepiece": "spm", "hf": "hf"}
MIN_BUCKET = 16  # the shortest padded row length


class SampleError(ValueError):
  """A workdir, run or prompt that cannot be sampled from (printed as one line, exit code 2)."""


class NoTokenizerError(SampleError):
  """The run's data has no tokenizer (`data.source="synthetic"`): prompts must be token ids."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """`directory/step`, the checkpoint to sample from (`choose_checkpoint`); `skipped`: one line
  naming the damaged newer ones passed over and the first bad file of each (None: none was)."""
  directory: str
  step: int
  skipped: str | None = None


def choose_checkpoint(workdir: str) -> Checkpoint:
  """The newest checkpoint of `WORKDIR/checkpoints` that matches its digest: the one the trainer
  would resume from (`checkpoint_digest.scan`, `problem`, newest first); moves nothing. Warns
  naming the damaged newer ones passed over (first bad file) and any entry that is no step.

  Raises:
    SampleError: `workdir` has no checkpoint, or none matches its digest (naming each one's
      problem).
  """
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  steps = (listing := digest_lib.scan(directory)).steps  # none when not a directory
  if not steps:
    why = ("has no step directory" if os.path.isdir(directory) else "is not a directory"
           if os.path.lexists(directory) else "does not exist")
    raise SampleError(f"--workdir {workdir!r} holds no checkpoint ({directory} {why})")
  damaged = []
  for step in steps:
    bad = digest_lib.problem(os.path.join(directory, str(step)), step)
    if bad is None:
      logging.log_if(logging.WARNING, "%s", listing.other, listing.skipped_line())
      skipped = (f"damaged checkpoint skipped: {'; '.join(damaged)}; sampling from the newest "
                 f"intact one, {directory}/{step}") if damaged else None
      logging.log_if(logging.WARNING, "%s", bool(damaged), skipped)
      return Checkpoint(directory=directory, step=step, skipped=skipped)
    damaged.append(f"{directory}/{step}: {' '.join(bad.split())}")
  raise SampleError(f"--workdir {workdir!r} holds no intact checkpoint ({'; '.join(damaged)}); "
                    "nothing to sample from")


def restore_item(checkpoint: Checkpoint, method: str, **kwargs: Any) -> Any:
  """`CheckpointManager.<method>(step, **kwargs)` of a manager that only reads; orbax's errors
  (a checkpoint that matches its digest but that it cannot read) become a SampleError."""
  with ocp.CheckpointManager(
      checkpoint.directory, options=ocp.CheckpointManagerOptions(create=False),
      item_handlers={"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()}) as manager:
    try:
      return getattr(manager, method)(checkpoint.step, **kwargs)
    except Exception as e:  # pylint: disable=broad-except
      raise SampleError(f"cannot read {checkpoint.directory}/{checkpoint.step}: "
                        f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from e


def run_config(workdir: str, *,
               checkpoint: Checkpoint | None = None) -> tuple[ml_collections.ConfigDict, int]:
  """The config that wrote the checkpoint (its `meta` item; `checkpoint` as in `sample`) and its
  step. Raises SampleError when `workdir` has no intact checkpoint."""
  checkpoint = checkpoint or choose_checkpoint(workdir)
  meta = restore_item(checkpoint, "restore",
                  args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  return ml_collections.ConfigDict(meta["config"]), checkpoint.step


def sampling_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` whose attention runs on XLA (no kernel settings, no mesh)."""
  copy = ml_collections.ConfigDict(config.to_dict())
  copy.attention.implementation = "xla"
  copy.attention.interpret = False
  return copy


def saved_vocab_size(state_metadata: Any, *, where: str) -> int:
  """Rows of the checkpoint's embedding table: the vocabulary the run trained with."""
  node = state_metadata["params"]["embed"]["embedding"]
  if isinstance(node, dict) or hasattr(node, "keys"):
    node = node["value"]
  if len(getattr(node, "shape", ())) != 2:
    raise SampleError(f"{where}: params.embed.embedding has no [V, E] shape: {node!r}")
  return int(node.shape[0])


def load_run(workdir: str, *, checkpoint: Checkpoint | None = None
             ) -> tuple[ml_collections.ConfigDict, model_lib.Decoder, int]:
  """The run's config, its model with the checkpoint's parameters, and that step.

  The model is `train.model.build` of the saved config with `attention.implementation="xla"`
  and the vocabulary size of the saved embedding table (the trainer's, whatever
  `model.vocab_size` says); only the parameters are read, onto the first device. `checkpoint`
  is as in `sample`; raises SampleError when `workdir` has no intact checkpoint.
  """
  checkpoint = checkpoint or choose_checkpoint(workdir)
  config, step = run_config(workdir, checkpoint=checkpoint)
  vocab = saved_vocab_size(restore_item(checkpoint, "item_metadata")["state"],
                            where=f"{checkpoint.directory}/{step}")
  abstract = nnx.eval_shape(lambda: model_lib.build(
      sampling_config(config), config.train.seed, vocab_size=vocab))
  graphdef, abstract_params = nnx.split(abstract)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {"params": jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)}
  restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=device), target)
  restored = restore_item(checkpoint, "restore", args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                   partial_restore=True)))
  return config, nnx.merge(graphdef, restored["state"]["params"]), step


def _dataset_tokenizer(dataset_dir: str) -> tokenizer_spec.Tokenizer:
  """The tokenizer recorded in a `segpack tokenize` dataset's manifest (`metadata.tokenizer`)."""
  path = os.path.join(dataset_dir, shards.MANIFEST_NAME)
  try:
    described = read_manifest(path).get("metadata", {}).get("tokenizer") or {}
  except (OSError, ValueError, AttributeError) as e:
    raise SampleError(f"data.train={dataset_dir!r}: cannot read {path}: {e}") from e
  kind = MANIFEST_TOKENIZER_KINDS.get(described.get("type"))
  if kind is None or not described.get("model_file"):
    raise SampleError(
        f"data.train={dataset_dir!r}: {path} names no tokenizer this can load (metadata."
        f"tokenizer type {described.get('type')!r}, model_file {described.get('model_file')!r};"
        f" types: {sorted(MANIFEST_TOKENIZER_KINDS)})")
  model_file = os.path.abspath(os.path.join(dataset_dir, described["model_file"]))
  try:
    tokenizer = tokenizer_spec.from_spec(f"{kind}:{model_file}")
  except (OSError, ValueError, ImportError) as e:
    raise SampleError(f"data.train={dataset_dir!r}: its tokenizer {model_file}: {e}") from e
  want = described.get("fingerprint")
  if want is not None and tokenizer.fingerprint != want:
    raise SampleError(
        f"data.train={dataset_dir!r}: its tokenizer {model_file} is not the one the dataset was "
        f"tokenized with (fingerprint {tokenizer.fingerprint}, {path} says {want}): damaged or "
        f"replaced")
  return tokenizer


def tokenizer_for_run(config: ml_collections.ConfigDict) -> tokenizer_spec.Tokenizer:
  """The tokenizer of the run that `config` describes (the built-in corpora's are cached).

  A dataset directory in `data.train` (written by `segpack tokenize`) takes precedence over
  `data.source`; its manifest names the tokenizer file.

  Raises:
    NoTokenizerError: `data.source="synthetic"` (random ids, no text).
    SampleError: the dataset's manifest names no loadable tokenizer.
  """
  dataset_dir = config.data.get("train")  # absent from older configs
  if dataset_dir:
    return _dataset_tokenizer(str(dataset_dir))
  source, size, cache_dir = config.data.source, config.data.size, config.data.cache_dir
  if source == "builtin":
    return tokenizer_spec.from_spec(
        "spm:" + str(corpus.ensure_builtin(size=size, cache_dir=cache_dir).spm_model))
  if source == "builtin_chat":
    return chat_corpus.chat_tokenizer(size=size, cache_dir=cache_dir)
  if source == "synthetic":
    raise NoTokenizerError(
        f"data.source={source!r} has no tokenizer: give the prompt as token ids, "
        f"--prompt_ids=5,6,7")
  raise SampleError(f"data.source={source!r} is not a source this can sample from")


def special_ids(config: ml_collections.ConfigDict,
                tokenizer: tokenizer_spec.Tokenizer | None) -> tuple[int | None, int | None]:
  """`(bos_id, eos_id)` as the run's documents carried them (None where `data.add_bos` /
  `data.add_eos` is off or the tokenizer has none)."""
  if tokenizer is None:
    bos, eos = data_lib.SYNTHETIC_BOS, data_lib.SYNTHETIC_EOS
  else:
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
  bos = bos if config.data.add_bos and bos is not None and bos >= 0 else None
  eos = eos if config.data.add_eos and eos is not None and eos >= 0 else None
  return bos, eos


def bucket_length(length: int, *, max_len: int | None = None) -> int:
  """The padded row length for `length` tokens: the next power of two (at least `MIN_BUCKET`),
  capped at `max_len`."""
  bucket = max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length())
  return bucket if max_len is None else max(min(bucket, max_len), length)


def padded_row(tokens: Sequence[int], *, length: int) -> dict[str, np.ndarray]:
  """`tokens` as the one document of a `[1, length]` row: `input_ids`, `segment_ids` (1, then 0
  on the padding) and `segment_positions` (0..n-1, then 0)."""
  n = len(tokens)
  if n > length:
    raise ValueError(f"padded_row: {n} tokens do not fit in length={length}")
  input_ids_1xS = np.zeros((1, length), np.int32)
  input_ids_1xS[0, :n] = tokens
  segment_ids_1xS = (np.arange(length) < n).astype(np.int32)[None]
  segment_positions_1xS = np.where(segment_ids_1xS[0] > 0, np.arange(length), 0)[None]
  return dict(input_ids=input_ids_1xS, segment_ids=segment_ids_1xS,
              segment_positions=segment_positions_1xS.astype(np.int32))


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef: Any, params: Any, row: dict[str, jax.Array],
               index: jax.Array) -> jax.Array:
  """The logits `[V]` at slot `index` of a `[1, S]` row (the training forward pass)."""
  model = nnx.merge(graphdef, params)
  logits_1xSxV = model(row["input_ids"], segment_ids=row["segment_ids"],
                       segment_positions=row["segment_positions"])
  return logits_1xSxV[0, index]


def last_logits(model: model_lib.Decoder, tokens: Sequence[int], *,
                max_len: int | None = None) -> jax.Array:
  """The logits `[V]` after the last of `tokens` (one document, padded to `bucket_length`):
  what `generate` picks the next token from."""
  graphdef, params = nnx.split(model)
  row = padded_row(tokens, length=bucket_length(len(tokens), max_len=max_len))
  return _logits_at(graphdef, params, row, jnp.int32(len(tokens) - 1))


def is_greedy(*, top_k: int, temperature: float) -> bool:
  """Whether these settings decode greedily (`top_k` 0 or 1, or `temperature` 0)."""
  return top_k <= 1 or temperature == 0


def pick_token(logits_V: jax.Array, *, top_k: int, temperature: float, key: jax.Array) -> int:
  """Argmax when `is_greedy`, else a draw from the `top_k` most likely tokens with
  probabilities `softmax(logits / temperature)`."""
  if is_greedy(top_k=top_k, temperature=temperature):
    return int(jnp.argmax(logits_V))
  values_K, ids_K = jax.lax.top_k(logits_V, min(top_k, logits_V.shape[-1]))
  return int(ids_K[jax.random.categorical(key, values_K / temperature)])


def _check_generate_args(prompt_ids: Sequence[int], *, vocab_size: int, max_new_tokens: int,
                         top_k: int, temperature: float, max_len: int | None) -> None:
  if not prompt_ids:
    raise SampleError(f"prompt_ids must hold at least one token, got {list(prompt_ids)!r}")
  bad = [i for i in prompt_ids if not 0 <= int(i) < vocab_size]
  if bad:
    raise SampleError(f"prompt_ids must lie in [0, {vocab_size}), got {bad[:8]!r}")
  for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
    if not isinstance(value, int) or value < 0:
      raise SampleError(f"{name} must be an int >= 0, got {value!r}")
  if not temperature >= 0:
    raise SampleError(f"temperature must be >= 0, got {temperature!r}")
  if max_len is not None and len(prompt_ids) + 1 > max_len:
    raise SampleError(f"the prompt ({len(prompt_ids)} tokens and BOS) does not fit in "
                      f"max_len={max_len}")


def generate(model: model_lib.Decoder, prompt_ids: Sequence[int], *, max_new_tokens: int,
             top_k: int = 0, temperature: float = 1.0, seed: int = 0, bos_id: int | None,
             eos_id: int | None = None, max_len: int | None = None) -> list[int]:
  """Decodes a continuation of `prompt_ids`, one full forward pass per new token (no KV cache).

  Args:
    model: the decoder (`load_run`).
    prompt_ids: the prompt's token ids (no BOS).
    max_new_tokens: the most tokens to add.
    top_k: 0 or 1: greedy (argmax); k > 1: sample among the k most likely tokens.
    temperature: divides the logits before sampling; 0: greedy.
    seed: the `jax.random` seed of the draws (step `t` uses `fold_in(key(seed), t)`).
    bos_id: put before the prompt, as the run's documents began (None: nothing).
    eos_id: stop after this token (None: never).
    max_len: the longest row (the run's `packing.seq_len`); decoding stops there.

  Returns:
    The new tokens, ending with `eos_id` when it was drawn.

  Raises:
    SampleError: an empty prompt, ids outside the vocabulary, a negative setting.
  """
  _check_generate_args(prompt_ids, vocab_size=model.cfg.vocab_size,
                       max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature,
                       max_len=max_len)
  tokens = ([] if bos_id is None else [int(bos_id)]) + [int(i) for i in prompt_ids]
  key, new = jax.random.key(seed), []
  while len(new) < max_new_tokens and (max_len is None or len(tokens) < max_len):
    logits_V = last_logits(model, tokens, max_len=max_len)
    token = pick_token(logits_V, top_k=top_k, temperature=temperature,
                       key=jax.random.fold_in(key, len(new)))
    tokens.append(token)
    new.append(token)
    if token == eos_id:
      break
  return new


def parse_ids(text: str) -> list[int]:
  """`"5,6,7"` -> `[5, 6, 7]`; raises SampleError naming `--prompt_ids` otherwise."""
  try:
    return [int(part) for part in text.split(",") if part.strip()]
  except ValueError as e:
    raise SampleError(f"--prompt_ids must be comma-separated ints, got {text!r}") from e


def _prompt(tokenizer: tokenizer_spec.Tokenizer | None, *, prompt: str | None,
            prompt_ids: str | None) -> list[int]:
  """The prompt's ids from `prompt_ids` (comma-separated) or the text `prompt`."""
  if prompt_ids is not None and prompt is not None:
    raise SampleError(f"give --prompt or --prompt_ids, not both (got --prompt={prompt!r} and "
                      f"--prompt_ids={prompt_ids!r})")
  if prompt_ids is not None:
    ids = parse_ids(prompt_ids)
    if not ids:
      raise SampleError(f"--prompt_ids holds no token id, got {prompt_ids!r}")
    return ids
  if not prompt:
    raise SampleError(f"give a non-empty --prompt (text) or --prompt_ids (comma-separated ids), "
                      f"got --prompt={prompt!r}")
  return [int(i) for i in tokenizer.encode(prompt)]


def sample(workdir: str, *, prompt: str | None = None, prompt_ids: str | None = None,
           num_samples: int = 3, max_new_tokens: int = 64, top_k: int = 0,
           temperature: float = 1.0, seed: int = 0,
           checkpoint: Checkpoint | None = None) -> list[str]:
  """Decodes continuations of a prompt from the newest intact checkpoint of `workdir` (what the
  command prints).

  Args:
    workdir: the run directory.
    prompt: the prompt text (encoded with the run's tokenizer).
    prompt_ids: or the prompt as comma-separated token ids (the only way for synthetic runs).
    num_samples: continuations to draw with top-k sampling (greedy decoding gives one).
    max_new_tokens, top_k, temperature, seed: as `generate` (sample `i` uses `seed + i`).
    checkpoint: the checkpoint to read (None: `choose_checkpoint(workdir)`).

  Returns:
    One text per continuation: the prompt and its continuation decoded, or, without a
    tokenizer, `"PROMPT IDS | NEW IDS"`.

  Raises:
    SampleError: no intact checkpoint, no prompt, a synthetic run without `prompt_ids`, a
      tokenizer that is not the model's.
  """
  if not isinstance(num_samples, int) or num_samples < 1:
    raise SampleError(f"--num_samples must be an int >= 1, got {num_samples!r}")
  checkpoint = checkpoint or choose_checkpoint(workdir)
  config, _ = run_config(workdir, checkpoint=checkpoint)
  try:
    tokenizer = tokenizer_for_run(config)
  except NoTokenizerError:
    if prompt_ids is None:
      raise
    tokenizer = None
  ids = _prompt(tokenizer, prompt=prompt, prompt_ids=prompt_ids)
  config, model, _ = load_run(workdir, checkpoint=checkpoint)
  if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:  # more rows: fine
    raise SampleError(f"the run's tokenizer ({tokenizer.spec}) has {tokenizer.vocab_size} ids, "
                      f"the checkpoint's model {model.cfg.vocab_size}: not the run's tokenizer")
  bos_id, eos_id = special_ids(config, tokenizer)
  greedy = is_greedy(top_k=top_k, temperature=temperature)
  texts = []
  for i in range(1 if greedy else num_samples):
    new = generate(model, ids, max_new_tokens=max_new_tokens, top_k=top_k,
                   temperature=temperature, seed=seed + i, bos_id=bos_id, eos_id=eos_id,
                   max_len=config.packing.seq_len)
    texts.append(",".join(map(str, ids)) + " | " + ",".join(map(str, new)) if tokenizer is None
                 else tokenizer.decode(ids + new))
  return texts


def define_flags() -> dict[str, Any]:
  """The command's flags (defined when run as a program only, so importing defines none)."""
  return dict(
      workdir=flags.DEFINE_string("workdir", None, "Run directory holding checkpoints/."),
      prompt=flags.DEFINE_string("prompt", None, "Prompt text (the run's tokenizer encodes it)."),
      prompt_ids=flags.DEFINE_string("prompt_ids", None,
                                     "Prompt as comma-separated token ids (synthetic runs)."),
      num_samples=flags.DEFINE_integer("num_samples", 3,
                                       "Continuations to draw (greedy decoding gives one)."),
      max_new_tokens=flags.DEFINE_integer("max_new_tokens", 64, "Most tokens per continuation."),
      top_k=flags.DEFINE_integer("top_k", 0, "0: greedy; k > 1: sample among the k most likely."),
      temperature=flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0: greedy."),
      seed=flags.DEFINE_integer("seed", 0, "Sample i uses seed + i."))


def main(argv, *, holders: dict[str, Any]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  values = {name: holder.value for name, holder in holders.items()}
  top_k, temperature = values["top_k"], values["temperature"]
  mode = ("greedy" if is_greedy(top_k=top_k, temperature=temperature)
          else f"top_k={top_k}, temperature={temperature}")
  workdir = values.pop("workdir")
  try:
    checkpoint = choose_checkpoint(workdir)  # its warning (a damaged checkpoint skipped) shows
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.ERROR)  # orbax warns about a manager it may not write to
    texts = sample(workdir, checkpoint=checkpoint, **values)
  except SampleError as e:
    print(f"train.sample: {e}", file=sys.stderr)
    sys.exit(2)
  for i, text in enumerate(texts):
    print(f"=== sample {i + 1}/{len(texts)} ({mode}) from step {checkpoint.step} ===")
    print(text)


if __name__ == "__main__":
  _HOLDERS = define_flags()
  flags.mark_flags_as_required(["workdir"])
  app.run(functools.partial(main, holders=_HOLDERS))

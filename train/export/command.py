r"""Exports a run's newest intact checkpoint as a Hugging Face model directory.

  python -m train.export --workdir runs/sft_hf --output exported
  python -m train.export --workdir runs/packed --output exported --max-shard-size 2GB --overwrite
  python -m train.export --workdir runs/lora --output adapter --adapter   # a PEFT adapter

The directory loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`: config.json (RoPE settings where transformers 4.x and 5.x
read them, the special ids, the dtype, tied or untied as trained), safetensors shards with their
index, generation_config.json, the tokenizer files and, for a run on chat data, the chat template
the data was rendered with. A run fine-tuned from a Hugging Face model (`model.init_from`) keeps
its source's config.json fields, special ids, generation config and tokenizer files
(`WORKDIR/hf_source`); a run trained from scratch is written as its `model.family` (a Llama by
default) with the run's tokenizer (`train.export.files` converts segpack's SentencePiece models).

Algorithm:
  1. The checkpoint: the newest one of `WORKDIR/checkpoints` matching its digest, and the config
     that wrote it (`train.runs.saved.choose_checkpoint`, `run_config`).
  2. The output: its parent must be a writable directory; `.NAME.export-lock` beside it is locked
     (`segpack.files.file_lock`, so two exports never write one directory; removed when the
     export ends); an existing non-empty `--output` is refused unless `--overwrite`; leftovers
     of a killed export are removed.
  3. The parameters are restored from the checkpoint onto all devices (split over them, as
     `train.sharding` splits parameters over `fsdp`), never gathered as a whole.
  4. Everything is written into the sibling `NAME.tmp-<pid>`: the safetensors shards (one
     parameter fetched at a time, at most one shard's tensors on the host,
     `hf_export.write_weights`), config.json, generation_config.json, the tokenizer files.
  5. `NAME.tmp-<pid>` is renamed to `NAME` (an old `NAME` is first renamed aside and removed
     after), so a directory named `--output` is always a complete export; its files have the
     mode the umask gives any new file (0644 with umask 022).

Example: a tiny Llama fine-tuned for 3 steps (21 tensors, 0.3 MB) gives `exported/` with
config.json, generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json;
with `--max-shard-size 40KB` the tensors go to model-00001-of-0000N.safetensors, ... and
model.safetensors.index.json names the file of each.

With several processes (`--distributed` on every host) every process restores its part and joins
the gathers, and process 0 writes the directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
from absl import logging as absl_logging
from jax.experimental import multihost_utils
import numpy as np
from flax import nnx

from segpack import files
from segpack import errors
from train import run_guard
from train.export import adapter as export_adapter
from train.export import files as hf_export
from train.hf import init_from as hf_init
from train.hf import weights as hf_weights
from train.model import decoder as model_lib
from train.runs import adapted
from train.runs import saved as saved_run
from train import sharding as sharding_lib
from train.export.files import ExportError

_LOG = logging.getLogger(__name__)
PROG = "python -m train.export"


@dataclasses.dataclass(frozen=True)
class ExportResult:
  """What `export` wrote: the directory, the checkpoint's step, the weight files, the tensors
  and their bytes, the tokenizer files, and whether a chat template was written."""
  output: str
  step: int
  weight_files: tuple[str, ...]
  num_tensors: int
  total_bytes: int
  tokenizer_files: tuple[str, ...]
  chat_template: bool


def _paths(output: str) -> tuple[Path, Path, Path]:
  """`(output, its parent, the lock file)` as absolute paths."""
  target = Path(os.path.abspath(output))
  return target, target.parent, target.parent / f".{target.name}.export-lock"


def _is_run(path: Path) -> bool:
  """Whether `path` is a run directory (it holds the trainer's record or lock file)."""
  return any((path / name).is_file() for name in (run_guard.RECORD_NAME, run_guard.LOCK_NAME))


def _export_name(name: str) -> bool:
  """Whether a file name is one an export writes (weights, index, config, tokenizer files)."""
  return (name in hf_init.SOURCE_FILES or name in (hf_weights.SINGLE_NAME, hf_weights.INDEX_NAME)
          or name in export_adapter.FILES
          or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None)


def check_runs(output: str, *, workdir: str) -> None:
  """Refuses an output that is, holds or is inside the run `workdir`, or lies inside another run
  (replacing it would delete the run), whatever `--overwrite` says."""
  target, run = Path(os.path.realpath(output)), Path(os.path.realpath(workdir))
  if target == run or run in target.parents or target in run.parents:
    where = ("is" if target == run else "is inside" if run in target.parents else "holds")
    raise ExportError(f"--output {output!r} {where} the run --workdir {workdir!r}: writing the "
                      f"export there would delete the run; choose a directory outside it")
  inside = next((p for p in (target, *target.parents) if p.is_dir() and _is_run(p)), None)
  if inside is not None:
    where = "is the" if inside == target else "is inside the"
    raise ExportError(f"--output {output!r} {where} run {str(inside)!r}: writing the export "
                      f"there would delete it; choose a directory outside any run")


def check_output(output: str, *, overwrite: bool, workdir: str | None = None) -> None:
  """Step 2's checks (one line each, naming `--output` and its value).

  Raises:
    ExportError: the parent is missing, not a directory or not writable; `output` is, holds or
      is inside a run (`check_runs`); `output` is a file, a non-empty directory without
      `overwrite`, or, with it, a directory holding anything an export does not write.
  """
  target, parent, _ = _paths(output)
  if workdir is not None:
    check_runs(output, workdir=workdir)
  if not parent.is_dir():
    raise ExportError(f"--output {output!r}: its parent {str(parent)!r} is not an existing "
                      f"directory")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ExportError(f"--output {output!r}: its parent {str(parent)!r} is not writable")
  if target.exists() and not target.is_dir():
    raise ExportError(f"--output {output!r} exists and is not a directory")
  held = sorted(target.iterdir()) if target.is_dir() else []
  foreign = [p.name for p in held if not (p.is_file() and not p.is_symlink()
                                          and _export_name(p.name))]
  if foreign:
    raise ExportError(f"--output {output!r} holds {foreign[:3]}, which an export does not "
                      f"write: --overwrite replaces only an earlier export; choose another "
                      f"directory or empty it")
  if held and not overwrite:
    raise ExportError(f"--output {output!r} exists and is not empty; pass --overwrite to "
                      f"replace it")


@contextlib.contextmanager
def output_lock(output: str) -> Iterator[None]:
  """Holds the output's lock file; another export holding it is one line naming its owner."""
  _, _, lock = _paths(output)
  try:
    with files.file_lock(lock, wait=False, remove=True):
      yield
  except files.LockHeldError as e:
    raise ExportError(f"--output {output!r} is being written by another export ({e.owner}; "
                      f"lock file {e.path})") from None


def _remove_leftovers(target: Path) -> None:
  """Removes `NAME.tmp-*` / `NAME.old-*` of killed exports (the lock is held: none is live)."""
  for pattern in (f"{target.name}.tmp-*", f"{target.name}.old-*"):
    for path in target.parent.glob(pattern):
      shutil.rmtree(path, ignore_errors=True)


def _umask() -> int:
  """The process's umask (set and restored: the only way to read it)."""
  current = os.umask(0o022)
  os.umask(current)
  return current


def _publish(staging: Path, target: Path) -> None:
  """Step 5: `staging` (its files flushed to disk first, so that a power loss after the rename
  leaves no truncated file) becomes `target`; an old `target` is renamed aside, then removed.
  Every file gets the mode the umask gives a new file (safetensors writes its files 0600)."""
  mode = 0o666 & ~_umask()
  for path in staging.iterdir():
    os.chmod(path, mode)
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  files.fsync_dir(staging)
  old = None
  if target.exists():
    old = target.with_name(f"{target.name}.old-{os.getpid()}")
    os.replace(target, old)
  os.replace(staging, target)
  files.fsync_dir(target.parent)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)


def _checkpoint_and_config(workdir: str) -> tuple[saved_run.Checkpoint, Any, int]:
  """Step 1 (a missing or damaged checkpoint is a `RunError` naming `--workdir`)."""
  checkpoint = saved_run.choose_checkpoint(workdir)
  config, step = saved_run.run_config(workdir, checkpoint=checkpoint)
  return checkpoint, config, step


def _agree(error: ExportError | None) -> None:
  """Raises `error` (process 0's check) on process 0 and a line saying so on the others, which
  would otherwise wait in the gathers for a process that stopped."""
  if jax.process_count() > 1:
    ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
    if not ok and error is None:
      raise ExportError("process 0 refused the export (its error line says why)")
  if error is not None:
    raise error


def export(*, workdir: str, output: str, max_shard_bytes: int = hf_export.DEFAULT_MAX_SHARD_BYTES,
           overwrite: bool = False, adapter: bool = False) -> ExportResult:
  """Writes the Hugging Face directory `output` of the newest intact checkpoint of `workdir`.

  Args:
    workdir: the run directory (holding `checkpoints/`).
    output: the directory to write (created; its parent must exist).
    max_shard_bytes: the most bytes of tensors per safetensors file.
    overwrite: replace an existing non-empty `output`.
    adapter: write the run's LoRA adapters as a PEFT adapter directory
      (`train.export.adapter`) instead of the model with them merged.

  Returns:
    What was written (`ExportResult`).

  Raises:
    RunError: no intact checkpoint, or one that cannot be read (`train.runs.errors`).
    ExportError: an unusable `output` (see `check_output`), a locked output, or a model /
      tokenizer with no Hugging Face equivalent.
  """
  if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or (
      max_shard_bytes < 1):
    raise ExportError(f"--max-shard-size must be at least 1 byte, got {max_shard_bytes!r}")
  hf_export.check_extras()
  checkpoint, config, _ = _checkpoint_and_config(workdir)
  writer = jax.process_index() == 0
  target, _, _ = _paths(output)
  staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
  with contextlib.ExitStack() as stack:
    refused = None
    if writer:
      try:
        check_output(output, overwrite=overwrite, workdir=workdir)  # before the lock (parents)
        stack.enter_context(output_lock(output))
        check_output(output, overwrite=overwrite, workdir=workdir)  # another export may have
        # written it meanwhile
        _remove_leftovers(target)
        _make_staging(staging, output)
        stack.callback(shutil.rmtree, staging, ignore_errors=True)  # gone once published
      except ExportError as e:
        refused = e
    _agree(refused)
    if adapter:
      checkpoint, (files_, count, size) = saved_run.read_newest(  # a newer one if it is deleted
          workdir, lambda c: export_adapter.write(str(staging), c, config), checkpoint=checkpoint)
      _publish(staging, target)
      return ExportResult(output=output, step=checkpoint.step, weight_files=tuple(files_),
                          num_tensors=count, total_bytes=size, tokenizer_files=(),
                          chat_template=False)
    checkpoint, (params, vocab) = saved_run.read_newest(  # a newer one if it is deleted
        workdir, lambda c: restore_params(c, config), checkpoint=checkpoint)
    weights = hf_export.write_weights(
        str(staging), params, hf_weights.model_tensor_map(config.model),
        dtype=config.model.param_dtype, max_shard_bytes=max_shard_bytes, write=writer)
    del params
    described = ((), False)
    if writer:
      described = hf_export.write_files(str(staging), config, workdir, vocab_size=vocab)
      _publish(staging, target)
  return ExportResult(output=output, step=checkpoint.step, weight_files=tuple(weights["files"]),
                      num_tensors=weights["tensors"], total_bytes=weights["total_size"],
                      tokenizer_files=tuple(described[0]), chat_template=described[1])


def _make_staging(staging: Path, output: str) -> None:
  """Creates the temporary sibling directory everything is written into (step 4)."""
  try:
    staging.mkdir()
  except OSError as e:
    raise ExportError(f"--output {output!r}: cannot create {str(staging)!r} "
                      f"({e.strerror or e})") from e


def restore_params(checkpoint: Any, config: Any) -> tuple[dict[str, Any], int]:
  """Step 3: `({parameter path: array split over all devices}, vocabulary)` of the checkpoint.

  The checkpoint is read as `train.runs.loaded.load_run` reads it (its `_restore`, the vocabulary of
  the saved embedding, the model built with XLA attention), but onto a mesh of every device with
  the parameters split over it (`fsdp`) instead of onto one device.
  """
  # pylint: disable=protected-access
  if adapted.is_adapted(config):  # the base of model.init_from with the adapters merged
    return (adapted.merged_params(checkpoint, config, sharding_lib.make_mesh(data=1, fsdp=-1)),
            int(config.model.vocab_size))
  where = f"{checkpoint.directory}/{checkpoint.step}"
  vocab = saved_run.saved_vocab_size(
      saved_run.restore_item(checkpoint, "item_metadata")["state"], where=where)
  abstract = model_lib.abstract(saved_run.sampling_config(config), vocab_size=vocab)
  _, abstract_params = nnx.split(abstract)
  mesh = sharding_lib.make_mesh(data=1, fsdp=-1)
  params = saved_run.restore_params(checkpoint, abstract_params,
                                    sharding_lib.param_shardings(abstract_params, mesh))
  return sharding_lib.flat_params(params), vocab


def build_parser() -> argparse.ArgumentParser:
  """The `python -m train.export` parser."""

  def size(text: str) -> int:
    try:
      return hf_export.parse_size(text)
    except ExportError as e:
      raise argparse.ArgumentTypeError(str(e)) from None

  parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="the run directory (holds checkpoints/)")
  parser.add_argument("--output", required=True, help="the directory to write")
  parser.add_argument("--max-shard-size", type=size, default=hf_export.DEFAULT_MAX_SHARD_BYTES,
                      help="the most bytes per safetensors file: 5GB (default), 500MB, 2GiB, ...")
  parser.add_argument("--adapter", action="store_true",
                      help="a run with LoRA adapters: write them as a PEFT adapter directory "
                           "(adapter_config.json, adapter_model.safetensors) instead of the "
                           "merged model")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an existing non-empty --output")
  parser.add_argument("--distributed", action="store_true",
                      help="call jax.distributed.initialize() (every host runs the command)")
  return parser


@errors.command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m train.export ...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  absl_logging.set_verbosity(absl_logging.ERROR)  # orbax warns about a read-only manager
  if args.distributed:
    jax.distributed.initialize()
  result = export(workdir=args.workdir, output=args.output, max_shard_bytes=args.max_shard_size,
                  overwrite=args.overwrite, adapter=args.adapter)
  if jax.process_index() == 0:
    print(f"wrote {result.output}: step {result.step}, {result.num_tensors} tensors "
          f"({result.total_bytes / 1e6:.1f} MB) in {len(result.weight_files)} file(s), "
          f"tokenizer files {list(result.tokenizer_files) or 'none'}"
          f"{', chat template' if result.chat_template else ''}")
  return 0


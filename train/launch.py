"""What `python -m train.main` does around `train.train_and_evaluate`: flags parsed with every
mistake one line (exit code 2), the default workdir, a Hugging Face config adopted, and how a run
ends (a `segpack.errors.UserError` in one line, exit 2, through `segpack.errors.command` as every
command; a signal after its checkpoint, 128 + the signal; a second Ctrl-C at once, 130).
"""

import hashlib
import json
import os
import shlex
import sys
import time
from typing import Any

import jax
import ml_collections
from absl import flags, logging

from segpack import errors
from segpack.text.chat import prompts as prompts_lib
from train import checkpoint_compat as ckpt_compat
from train.adapters import trainable
from train.hf import config as hf_config
from train import run_guard
from train.runs import tokenizer as run_tokenizer
from train import train


def default_workdir(config_path: str, overrides: dict[str, Any] | None = None) -> str:
  """`configs/packed.py:smoke` -> `./runs/packed_smoke`; with `--config.*` overrides that a run
  cannot resume across (any key outside `train.checkpoint_compat.RESUMABLE_CHANGES`), a suffix of
  their hash, so that two documented commands never share a workdir by accident:
  `--config.data.train=data/mine` -> `./runs/packed-5dd894db`."""
  path, _, arg = config_path.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  name = f"{name}_{arg}" if arg else name
  kept = {k: v for k, v in (overrides or {}).items() if k not in ckpt_compat.RESUMABLE_CHANGES}
  if kept:
    digest = hashlib.sha256(json.dumps(sorted(kept.items()), default=str).encode()).hexdigest()
    name = f"{name}-{digest[:8]}"
  return os.path.join("runs", name)


PROG = "python -m train.main"


def _fail(message: str) -> None:
  raise errors.UsageError(message)


def _config_argument(argv: list[str]) -> str | None:
  """The value of `--config` in `argv` (`--config=X` or `--config X`), None if absent."""
  for i, arg in enumerate(argv[1:], start=1):
    for prefix in ("--config=", "-config="):
      if arg.startswith(prefix):
        return arg[len(prefix):]
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _root_cause(error: BaseException) -> BaseException:
  """The first exception of `error`'s chain (`__cause__`, else `__context__`)."""
  while (error.__cause__ or error.__context__) is not None:
    error = error.__cause__ or error.__context__
  return error


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, every error a `UsageError` (one line, exit code 2): a missing config file, a
  `get_config` that refuses its argument (`configs/packed.py`'s `UnknownVariantError`: the
  message of its first exception), an unknown flag or config key, a bad override value.

  Args:
    argv: the command line, program name first.

  Returns:
    The arguments absl leaves unparsed (program name first), for `main`.
  """
  config_arg = _config_argument(argv)
  if config_arg is not None:
    path = config_arg.partition(":")[0]
    if not os.path.isfile(path):
      _fail(f"--config={config_arg}: no config file {path!r} (from {os.getcwd()!r})")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    if config_arg is not None and str(e).startswith("flag --config="):  # get_config raised
      _fail(f"--config={config_arg}: {_root_cause(e)}")
    _fail(str(e).strip().splitlines()[0])
  except AttributeError as e:  # a --config.a.b override naming no key of the locked config
    detail = e.args[0] if e.args else e
    detail = detail.args[0] if isinstance(detail, KeyError) and detail.args else detail
    _fail(f"a --config.* override names no config key: {' '.join(str(detail).split())}")
  return argv


def run(config: ml_collections.ConfigDict, *, workdir: str | None, config_filename: str,
        overrides: dict[str, Any], distributed: bool) -> int:
  """Trains `config` in `workdir` (None: `default_workdir`), ending as the module docstring says.

  Args:
    config: the parsed config.
    workdir: `--workdir`, or None.
    config_filename: `--config`'s value (names the default workdir).
    overrides: the `--config.*` overrides given (`config_flags.get_override_values`).
    distributed: call `jax.distributed.initialize()` first.

  Returns:
    The exit status: 0, 128 + the signal that stopped the run, or 130 for a second Ctrl-C (a
    `UserError` propagates, to `segpack.errors.command`).
  """
  started = time.perf_counter()
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO; --verbosity=0 shows it
  if distributed:
    jax.distributed.initialize()
  workdir = workdir or default_workdir(config_filename, overrides)
  try:
    run_guard.absolute_paths(config)  # recorded where they are, whatever directory reads them
    hf_config.adopt(config, explicit=set(overrides))  # model.init_from: config.json decides
    trainable.adopt_adapter(config, explicit=set(overrides))  # adapter_config.json does
    summary = train.train_and_evaluate(config, workdir)
  except run_guard.RunStopped as e:  # SIGINT / SIGTERM: checkpoint saved at a step boundary
    print(f"{PROG}: {e}", file=sys.stderr, flush=True)
    return 128 + e.signum
  except KeyboardInterrupt:  # a second Ctrl-C: stop at once, the newest checkpoint stays
    print(f"{PROG}: interrupted; resume from the newest checkpoint with the same command",
          file=sys.stderr, flush=True)
    return 130
  if jax.process_index() == 0 and summary is not None:
    print(what_next(config, workdir, wall_s=time.perf_counter() - started), flush=True)
  return 0


def _first_prompt(config: ml_collections.ConfigDict) -> str | None:
  """The first text prompt of an RL run's prompts dataset (None: messages, or unreadable)."""
  try:
    with open(os.path.join(str(config.data.train), prompts_lib.RECORDS_NAME), "rb") as f:
      prompt = json.loads(f.readline()).get("prompt")
  except (OSError, ValueError, TypeError, AttributeError):
    return None
  return prompt if isinstance(prompt, str) else None


def what_next(config: ml_collections.ConfigDict, workdir: str, *, wall_s: float | None) -> str:
  """The run's last lines: its wall time, then the commands that read it, with its workdir."""
  if config.data.source == "synthetic":
    prompt = "--prompt_ids 1,5,6,7"
  elif config.rl.loss != "none" and (first := _first_prompt(config)) is not None:
    prompt = f"--prompt {shlex.quote(first)}"  # an RL run: one of its own prompts
  elif run_tokenizer.is_chat(config):
    prompt = '--chat --prompt "What does zip do?"'
  else:
    prompt = '--prompt "def "'
  adapter = int(config.model.lora.rank) > 0
  commands = [
      (f"python -m train.sample --workdir {workdir} {prompt}", "its answers"),
      (f"python -m train.plot {workdir}", "loss curves to a PNG"),
      (f"tensorboard --logdir {workdir}/tensorboard", "the same metrics (pip install tensorboard)"),
      (f"python -m train.export --workdir {workdir} --output exported"
       + (" --adapter" if adapter else ""), "a PEFT adapter" if adapter else "a Hugging Face model")]
  width = max(len(c) for c, _ in commands)
  took = "" if wall_s is None else f" in {wall_s:,.1f} s of wall time"
  return "\n".join([f"{PROG}: done{took}; {workdir} holds the run. Next:"]
                   + [f"  {c.ljust(width)}  # {why}" for c, why in commands])

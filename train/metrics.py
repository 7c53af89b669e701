"""Run metrics: a printed line and a JSON line in `WORKDIR/metrics.jsonl` per log step and eval.

Records carry a `kind`: `train` (step, loss, lr, grad_norm, real_tokens_per_s, slot_utilization,
model_flops_per_s, mfu (null when the peak FLOP/s is unknown), elapsed_s, eta_s, ...), `eval`
(step, eval_loss, eval_tokens) and `summary` (the final one). Only process 0 writes. Each line is
written with one `write` call on a file opened in append mode and flushed, so a killed run leaves
whole lines.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import numpy as np

from train import data as data_lib
from train.model import flops as flops_lib
from train import memory as memory_lib

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # `tensorboard --logdir WORKDIR/tensorboard`


def _percent(value: float | None) -> str:
  return "n/a" if value is None else f"{value:.1%}"


def no_description(record: dict[str, Any], prefix: str = "") -> str:
  """What a record's printed line adds when its objective adds nothing."""
  del record, prefix
  return ""


def _format(record: dict[str, Any], describe: Callable[..., str] = no_description) -> str:
  """The printed line of a record; `describe(record, prefix)` adds an objective's own part
  (`train.objective.Objective.describe`)."""
  kind = record.get("kind", "train")
  if kind == "train":
    return (f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"gnorm {record['grad_norm']:.3f} | {record['real_tokens_per_s']:,.0f} real tok/s | "
            f"util {record['slot_utilization']:.1%} | MFU {_percent(record.get('mfu'))} | "
            f"{record['elapsed_s']:.0f}s elapsed, ETA {record['eta_s']:.0f}s{describe(record)}")
  if kind == "eval":
    sources = "".join(f" | {k.split('/', 1)[1]} {v:.4f}" for k, v in record.items()
                      if k.startswith("eval_loss/") and v is not None)
    return (f"step {record['step']:>6} | eval loss {record['eval_loss']:.4f} over "
            f"{record['eval_tokens']:,} tokens{sources}{describe(record, 'eval_')}")
  body = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in record.items() if k != "kind")
  return f"{kind}: {body}"


def summary_writer(logdir: str) -> Any:
  """tensorboardX's `SummaryWriter` for `logdir`, imported without PyTorch.

  tensorboardX imports torch whenever it is installed (about a second of every run's start, and
  its messages), only to accept torch tensors, which the trainer never passes; with torch marked
  absent while it is imported it takes numpy arrays alone. A process that has already imported
  torch keeps it.
  """
  if "torch" in sys.modules:
    import tensorboardX  # optional: imported on first use, torch already loaded
    return tensorboardX.SummaryWriter(logdir)
  sys.modules["torch"] = None  # type: ignore[assignment]  # "not installed", for this import
  try:
    import tensorboardX  # optional: imported on first use, without torch (see above)
  finally:
    del sys.modules["torch"]
  return tensorboardX.SummaryWriter(logdir)


class MetricsWriter:
  """Prints records, appends them as JSON lines and writes their numbers as TensorBoard scalars
  (`WORKDIR/tensorboard`, through tensorboardX; tag `train/loss`, `eval/eval_loss/web`, ...);
  process 0 only."""

  def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True, echo: bool = True,
               describe: Callable[..., str] = no_description):
    self.path = os.path.join(os.fspath(workdir), METRICS_FILE)
    self.describe = describe
    self.enabled = enabled
    self.echo = echo
    self._board = (summary_writer(os.path.join(os.fspath(workdir), TENSORBOARD_DIR))
                   if enabled else None)

  def write(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    record = {k: (float(v) if hasattr(v, "dtype") and getattr(v, "ndim", 1) == 0 else v)
              for k, v in record.items()}
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(json.dumps(record, sort_keys=True) + "\n")
      f.flush()
    kind = record.get("kind", "train")
    if kind in ("train", "eval") and "step" in record:
      for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
          self._board.add_scalar(f"{kind}/{key}", value, global_step=int(record["step"]))
      self._board.flush()
    if self.echo:
      print(_format(record, self.describe), flush=True)

  def close(self) -> None:
    """Closes the TensorBoard event file."""
    if self._board is not None:
      self._board.close()


def read(workdir: str | os.PathLike) -> list[dict[str, Any]]:
  """All records of `WORKDIR/metrics.jsonl` (a truncated last line is skipped)."""
  path = os.path.join(os.fspath(workdir), METRICS_FILE)
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


class Throughput:
  """Tokens per second, model FLOP/s, MFU and ETA between log steps (wall clock, excluding nothing).

  Model FLOPs count only real tokens and within-document attention (`train/model/flops.py`); MFU divides
  their rate by `peak_flops` (all devices together), and is None when that is unknown.
  """

  def __init__(self, *, start_step: int, num_steps: int,
               flop_model: flops_lib.FlopModel | None = None, peak_flops: float | None = None):
    self.t0 = self.t_last = time.perf_counter()
    self.start_step = self.last_step = start_step
    self.num_steps = num_steps
    self.flop_model = flop_model
    self.peak_flops = peak_flops
    self.real_tokens = 0.0
    self.slots = 0.0
    self.flops = 0.0

  def add(self, *, real_tokens: float, slots: float, attention_pairs: float = 0.0) -> None:
    self.real_tokens += real_tokens
    self.slots += slots
    if self.flop_model is not None:
      self.flops += self.flop_model.step_flops(real_tokens=real_tokens,
                                               attention_pairs=attention_pairs)

  def report(self, step: int) -> dict[str, Any]:
    """Rates since the last report and elapsed/ETA since start; resets the window."""
    now = time.perf_counter()
    window = max(now - self.t_last, 1e-9)
    elapsed = now - self.t0
    done = max(step - self.start_step, 1)
    flops_per_s = None if self.flop_model is None else self.flops / window
    out = dict(real_tokens_per_s=self.real_tokens / window,
               slot_utilization=self.real_tokens / max(self.slots, 1.0),
               elapsed_s=elapsed, eta_s=elapsed / done * (self.num_steps - step),
               steps_per_s=(step - self.last_step) / window,
               model_flops_per_s=flops_per_s,
               mfu=(None if flops_per_s is None or self.peak_flops is None
                    else flops_per_s / self.peak_flops))
    self.t_last, self.last_step = now, step
    self.real_tokens = self.slots = self.flops = 0.0
    return out


def train_record(step: int, window: list[dict[str, Any]], meter: "Throughput",
                 objective: Any) -> dict[str, Any]:
  """One `train` record from the (fetched) metrics of the steps since the last record; the
  objective adds its own means (`train.objective.Objective.window_means`)."""
  for m in window:
    meter.add(real_tokens=float(m["real_tokens"]), slots=float(m["slots"]),
              attention_pairs=float(m["attention_pairs"]))
  # Each step's loss weighted by its normaliser (trained tokens, or documents under
  # loss.weighting="sequence"): the window's loss as one batch of all its steps would give it.
  counts = sum(float(m["loss_count"]) for m in window)
  loss = sum(float(m["loss"]) * float(m["loss_count"]) for m in window) / max(counts, 1.0)
  last = window[-1]
  record = dict(kind="train", step=step, loss=loss, lr=float(last["lr"]),
                grad_norm=float(last["grad_norm"]), **meter.report(step))
  record.update(objective.window_means(window, counts))
  return record


def announce(run: Any, *, record_name: str) -> None:
  """The run's first lines: workdir and steps, data, model, and any changes on resume."""
  t, c = run.config.train, run.config
  start = (f"resuming at step {run.start_step}" if run.start_step else
           "starting from the weights of model.init_from" if c.model.init_from else
           "from scratch")
  init = f", weights from {c.model.init_from}" if c.model.init_from else ""
  print(f"workdir {run.workdir} (config and data fingerprints in {record_name}): "
        f"{t.num_steps} steps of {t.batch_size} rows x {c.packing.seq_len} slots, {start}",
        flush=True)
  print(f"data: {run.data.description}", flush=True)
  if getattr(run, "recipe", None) is not None:
    print(run.recipe.line, flush=True)
    if run.recipe.warning is not None:
      print(f"warning: {run.recipe.warning}", file=sys.stderr, flush=True)
  if getattr(run, "memory", None) is not None:
    print(run.memory.line(memory_lib.device_memory()), flush=True)
  lora = c.model.lora
  adapters = (f" (LoRA rank {lora.rank}, alpha {lora.alpha:g}, on {lora.targets}) over a frozen "
              f"base of {getattr(run, 'frozen_params', 0):,} ({lora.base_dtype})"
              if lora.rank else "")
  print(f"model: {c.model.family}, {run.num_params:,} {'trained ' if lora.rank else ''}"
        f"parameters{adapters}{init}; mesh {dict(run.mesh.shape)}", flush=True)
  if getattr(run, "reference", None):
    print(run.reference, flush=True)
  if run.resume_changes:
    print(f"resuming at data position {run.iterator.get_state()} with changes: "
          f"{'; '.join(run.resume_changes)}", flush=True)


def log_batch(path: str | None, step: int, local: dict[str, np.ndarray],
               position: dict[str, Any] | None = None, plan_rows: Any = None) -> None:
  """Appends the step's batch fingerprints, the data position the batch started at and (global
  packing) every local row's `[epoch, plan row]` to `path` (nothing when None)."""
  if path is None:
    return
  whole, rows = data_lib.fingerprint(local)
  record = dict(step=step, fingerprint=whole, rows=rows, position=position)
  if plan_rows is not None:
    record["plan_rows"] = np.stack(plan_rows, axis=1).tolist()
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(record) + "\n")
    f.flush()

"""Draws a run's curves: `python -m train.plot WORKDIR [--out PATH]` -> `WORKDIR/curves.png`.

Panels: train and eval loss (and each mixture source's, dashed), learning rate, gradient norm, real tokens/s, all against the step;
an RL run (`rl.loss`) adds its reward: the sampled rounds' mean and the held-out prompts' (greedy).
Needs matplotlib (`pip install segpack[plot]`).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import sys

from segpack import errors
from segpack.files import atomic_write_bytes
from train import metrics as metrics_lib


def source_names(train: list[dict]) -> list[str]:
  """A mixture's source names, from the `loss/<name>` keys of the train records."""
  return sorted({k.split("/", 1)[1] for r in train for k in r if k.startswith("loss/")})


def plot(workdir: str, *, out: str | None = None) -> str:
  """Writes the PNG (atomically) and returns its path.

  Raises:
    FileNotFoundError: `WORKDIR/metrics.jsonl` does not exist.
    ValueError: it holds no train records.
  """
  import matplotlib  # optional: the [plot] extra; the trainer runs without it
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # optional: the [plot] extra, after choosing Agg

  records = metrics_lib.read(workdir)
  train = [r for r in records if r.get("kind") == "train"]
  evals = [r for r in records if r.get("kind") == "eval"]
  if not train:
    raise errors.UsageError(
        f"{os.path.join(workdir, metrics_lib.METRICS_FILE)} holds no train records")
  steps = [r["step"] for r in train]
  rewards = any("reward" in r for r in train)
  fig, axes = plt.subplots(1, 5 if rewards else 4, figsize=(22 if rewards else 18, 4))
  axes[0].plot(steps, [r["loss"] for r in train], label="train")
  if evals:
    axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
  for name in source_names(train):  # a mixture: one train and one eval curve per source
    points = [(r["step"], r[f"loss/{name}"]) for r in train if r.get(f"loss/{name}") is not None]
    if points:
      axes[0].plot(*zip(*points), "--", label=f"train {name}")
    held = [(r["step"], r[f"eval_loss/{name}"]) for r in evals if f"eval_loss/{name}" in r]
    if held:
      axes[0].plot(*zip(*held), "o:", label=f"eval {name}")
  axes[0].set_title("loss")
  axes[0].legend()
  for ax, key in zip(axes[1:], ("lr", "grad_norm", "real_tokens_per_s")):
    ax.plot(steps, [r[key] for r in train])
    ax.set_title(key)
  if rewards:
    _reward_panel(axes[4], train, evals)
  for ax in axes:
    ax.set_xlabel("step")
  fig.tight_layout()
  out = out or os.path.join(workdir, "curves.png")
  buf = io.BytesIO()  # rendered in memory, then written atomically (temporary file + rename)
  try:
    fig.savefig(buf, dpi=100, format="png")
  finally:
    plt.close(fig)
  atomic_write_bytes(pathlib.Path(out), buf.getvalue())
  return out


def _reward_panel(ax, train: list[dict], evals: list[dict]) -> None:
  """An RL run's reward curve: the rounds' mean reward, and the held-out prompts' (greedy)."""
  points = [(r["step"], r["reward"]) for r in train if r.get("reward") is not None]
  ax.plot(*zip(*points), label="sampled")
  held = [(r["step"], r["eval_reward"]) for r in evals if r.get("eval_reward") is not None]
  if held:
    ax.plot(*zip(*held), "o-", label="held-out (greedy)")
  ax.set_title("reward")
  ax.legend()


@errors.command("python -m train.plot")
def main(argv: list[str] | None = None) -> int:
  """Plots WORKDIR's curves; a missing or unreadable file ends with one line, exit status 2."""
  parser = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__)
  parser.add_argument("workdir", type=errors.directory,
                      help="a run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None, help="PNG path (default WORKDIR/curves.png)")
  args = parser.parse_args(argv)
  try:
    print(plot(args.workdir, out=args.out))
  except ModuleNotFoundError as e:
    print(f"train.plot needs matplotlib ({e}); pip install 'segpack[plot]'", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())

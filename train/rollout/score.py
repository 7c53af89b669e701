r"""Scores completions with the trainer's forward pass: `python -m train.rollout.score`.

  python -m train.sample --workdir RUN --prompt "def " --num_samples 8 --temperature 1 \
      --output answers.jsonl
  python -m train.rollout.score --workdir RUN --completions answers.jsonl --output scores.jsonl

Every line of COMPLETIONS (`train.sample --output`: `prompt_ids`, `token_ids`, `temperature`, and
the sampler's `logprobs`) is scored once on packed rows by `sequence_logprobs`
(`train.rollout.logprobs`), the per-token log-probs the trainer computes, at the line's
temperature (or `--temperature`). OUTPUT holds one JSON line per completion, `prompt`, `sample`,
`logprobs`; the summary line gives the largest difference from the sampler's own log-probs,
the figure that says whether sampler and trainer agree (float rounding only: about 1e-6 in
float32). OUTPUT is written once, atomically, and never over an existing file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import errors
from segpack import files
from segpack.errors import UserError
from train.rollout import logprobs as logprobs_lib
from train.rollout.sampling import DecodeError
from train.runs import loaded as loaded_run

PROG = "python -m train.rollout.score"
FIELDS = ("prompt_ids", "token_ids")


class ScoreError(UserError, ValueError):
  """Completions or an output that cannot be scored (one line, exit code 2)."""


def read_completions(path: str) -> list[dict[str, Any]]:
  """The lines of a `train.sample --output` file, each checked for its ids (file:line)."""
  try:
    text = Path(path).read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise ScoreError(f"--completions {path}: {errors.one_line(e)}") from e
  out = []
  for n, raw in enumerate(text.splitlines(), start=1):
    if not raw.strip():
      continue
    try:
      line = json.loads(raw)
    except json.JSONDecodeError as e:
      raise ScoreError(f"--completions {path}:{n}: not JSON ({e.msg})") from e
    if not isinstance(line, dict) or any(not isinstance(line.get(k), list) for k in FIELDS):
      raise ScoreError(f"--completions {path}:{n}: a line needs {' and '.join(FIELDS)} "
                       f"(lists of token ids, as train.sample --output writes)")
    out.append(line)
  if not out:
    raise ScoreError(f"--completions {path}: no completion in the file")
  return out


def score(*, workdir: str, completions: str, output: str, temperature: float | None,
          batch_size: int) -> dict[str, Any]:
  """Runs the command; returns its summary."""
  out = Path(output)
  if out.exists():
    raise ScoreError(f"--output {output}: the file exists; give a new path")
  lines = read_completions(completions)
  config, model, step = loaded_run.load_run(workdir)
  temperatures = {temperature if temperature is not None else float(line.get("temperature", 1))
                  for line in lines}
  scored: list[np.ndarray | None] = [None] * len(lines)
  for t in sorted(temperatures):  # one pass per temperature the file holds
    chosen = [i for i, line in enumerate(lines)
              if (temperature if temperature is not None else line.get("temperature", 1)) == t]
    try:
      got = logprobs_lib.sequence_logprobs(
          model, [(lines[i]["prompt_ids"], lines[i]["token_ids"]) for i in chosen],
          seq_len=int(config.packing.seq_len), temperature=t, batch_size=batch_size)
    except DecodeError as e:
      raise ScoreError(f"--completions {completions}: {e}") from e
    for i, g in zip(chosen, got):
      scored[i] = g
  gaps = [float(np.max(np.abs(s - np.asarray(line["logprobs"]))))
          for s, line in zip(scored, lines) if len(line.get("logprobs", ())) == len(s)]
  data = "".join(json.dumps(dict(prompt=line.get("prompt"), sample=line.get("sample"),
                                 logprobs=[float(x) for x in s])) + "\n"
                 for s, line in zip(scored, lines))
  with files.file_lock(out.with_name(out.name + ".lock"), wait=False, remove=True):
    if out.exists():
      raise ScoreError(f"--output {output}: the file appeared while scoring; not overwritten")
    files.atomic_write_bytes(out, data.encode())
  return dict(completions=len(lines), step=step, output=str(out),
              largest_gap=max(gaps) if gaps else None)


@errors.command(PROG)
def main(argv: Sequence[str] | None = None) -> int:
  """Parses the flags and scores; a user's mistake is one line and exit code 2."""
  p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", required=True, help="a run directory: its newest intact checkpoint")
  p.add_argument("--completions", required=True, help="a train.sample --output file")
  p.add_argument("--output", required=True, help="the JSON-lines file to write (new)")
  p.add_argument("--temperature", type=errors.at_least(1e-6, float), default=None,
                 help="score at this temperature (default: each line's own)")
  p.add_argument("--batch-size", type=errors.at_least(1), default=8, help="rows per forward")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  summary = score(workdir=args.workdir, completions=args.completions, output=args.output,
                  temperature=args.temperature, batch_size=args.batch_size)
  gap = summary["largest_gap"]
  print(f"{PROG}: {summary['completions']:,} completions scored with step {summary['step']} "
        f"into {summary['output']}; largest difference from the sampler's log-probs: "
        f"{'not measured (no logprobs in the file)' if gap is None else f'{gap:.2e}'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

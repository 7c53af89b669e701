"""`train.sample --output FILE`: every completion as one JSON line, written once, atomically.

A line holds `prompt` and `sample` (0-based indices), `text` (what the command prints for it: the
prompt and continuation, or the chat answer), `completion` (the completion's own text, cut before
a stop string), `token_ids`, `logprobs` (under the model at the sampling temperature, whole
vocabulary), `sampling_logprobs` (under the distribution drawn from), `finish_reason` ("stop",
"stop_string", "length", "room"), `stop` (the stop id or string that ended it, else null), the
checkpoint's `step`, `prompt_ids` (the prompt as the model saw it) and `temperature` (that of
`logprobs`): what `python -m train.rollout.score` reads to score the same tokens as the
trainer. The file is checked before decoding (it must not exist; its directory must) and
appears whole or not at all (`segpack.files.atomic_write_bytes(replace=False)`: a temporary file
beside it, then linked to its name, which fails rather than replace a file another process wrote
meanwhile).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

from segpack import files
from train.sample.prompts import SampleError


def check_output(path: str) -> pathlib.Path:
  """The output's path; raises SampleError if it exists or its directory does not."""
  out = pathlib.Path(path)
  if out.exists() or out.is_symlink():
    raise SampleError(f"--output {path}: the file exists; give a new path (nothing is "
                      f"overwritten)")
  if not out.parent.is_dir():
    raise SampleError(f"--output {path}: the directory {str(out.parent)!r} does not exist")
  return out


def line(answer: Any) -> dict[str, Any]:
  """One answer (`train.sample.command.Answer`) as its JSON object."""
  c = answer.completion
  return dict(prompt=answer.prompt, sample=answer.sample, text=answer.text,
              completion=c.text, token_ids=list(c.token_ids), logprobs=list(c.logprobs),
              sampling_logprobs=list(c.sampling_logprobs), finish_reason=c.finish_reason,
              stop=c.stop, step=answer.step, prompt_ids=list(answer.prompt_ids),
              temperature=answer.temperature)


def write(path: pathlib.Path, answers: Sequence[Any]) -> None:
  """Writes the answers' lines to `path`, which must still not exist."""
  data = "".join(json.dumps(line(a), ensure_ascii=False) + "\n" for a in answers).encode()
  try:
    files.atomic_write_bytes(path, data, replace=False)
  except FileExistsError:
    raise SampleError(f"--output {path}: the file appeared while decoding; nothing was "
                      f"overwritten") from None

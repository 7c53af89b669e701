"""The files of a Hugging Face tokenizer directory that hold a chat template, and their digests.

`template_file` is the one rule of "this directory holds a chat template"; `COPY_NAMES` are the
tokenizer and template files a chat dataset keeps copies of (with their SHA-256 in the manifest).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from segpack import files
from segpack.text.tokenizers import hf

__all__ = ["COPY_NAMES", "TEMPLATE_FILES", "has_template", "json_template", "sha256",
           "template_file"]

# The files of a tokenizer directory that hold only a chat template (`template_file`).
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# The tokenizer and template files a dataset keeps copies of (those present in the source).
COPY_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "tokenizer.model", "vocab.json", "merges.txt")


def sha256(path: Path) -> str:
  """`"sha256:<hex>"` of the file at `path`."""
  return "sha256:" + files.sha256_file(path)


def json_template(path: Path, key: str = "chat_template") -> Any:
  """The `key` of the JSON object in `path` (None when unreadable, not an object or absent)."""
  try:
    found = json.loads(path.read_text("utf-8"))
  except (OSError, ValueError):
    return None
  return found.get(key) if isinstance(found, dict) else None


def template_file(directory: str | Path) -> Path | None:
  """The file holding the chat template of the tokenizer directory `directory`, or None when
  there is none: the one rule of "this directory holds a chat template".

  In order: `chat_template.jinja` (transformers' own file, which it prefers),
  `chat_template.json` (`{"chat_template": "..."}`, as transformers saves a processor's),
  `tokenizer_config.json` holding a `chat_template`.
  """
  jinja, in_json = (Path(directory) / name for name in TEMPLATE_FILES)
  if jinja.is_file():
    return jinja
  for path in (in_json, Path(directory) / hf.CONFIG_NAME):
    if json_template(path):
      return path
  return None


def has_template(directory: str | Path) -> bool:
  """Whether the tokenizer directory `directory` holds a chat template (`template_file`)."""
  return template_file(directory) is not None

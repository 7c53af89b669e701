"""What segpack asks of a tokenizer (`Tokenizer`), and tokenizers named by a picklable string.

A *spec* names a tokenizer file with its kind: `"spm:/abs/path/m.model"` (SentencePiece,
`segpack.text.tokenizers.spm.SpmTokenizer`) or `"hf:/abs/path/tokenizer.json"` (a Hugging Face
tokenizer, `segpack.text.tokenizers.hf.HfTokenizer`, extra `segpack[hf]`). Every tokenizer carries
its own `spec` (absolute path), so a worker process rebuilds the same tokenizer with
`from_spec(tok.spec)` instead of pickling it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from segpack.errors import ArgumentError, ArgumentTypeError
from segpack.text.tokenizers import hf as hf_lib
from segpack.text.tokenizers import spm as spm_lib

__all__ = ["KINDS", "Tokenizer", "from_spec", "split_spec"]

KINDS = ("spm", "hf")


@runtime_checkable
class Tokenizer(Protocol):
  """A tokenizer that `segpack tokenize` can write shards with.

  Attributes:
    spec: `"<kind>:<absolute path>"`; `from_spec(spec)` rebuilds an equal tokenizer.
    fingerprint: `"sha256:<hex>"` of the file(s) that define it; stored in shard manifests.
    vocab_size: every id is `< vocab_size`.
    dtype: the shard token dtype (`segpack.shards.dtype_for_vocab(vocab_size)`).
    bos_id, eos_id, pad_id: special ids (None, or -1 for SentencePiece, when the tokenizer has
      none); `describe()` records them for the packing pipeline.
  """

  spec: str
  fingerprint: str
  vocab_size: int
  dtype: np.dtype
  bos_id: int | None
  eos_id: int | None
  pad_id: int | None

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` in `dtype`, no BOS/EOS added."""
    ...

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` of each text."""
    ...

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """Text of token ids."""
    ...

  def describe(self) -> dict[str, Any]:
    """JSON-ready description for the manifest's `metadata.tokenizer`: `type`, `model_file`,
    `fingerprint`, `vocab_size`, `pad_id`, `unk_id`, `bos_id`, `eos_id`."""
    ...


def split_spec(spec: str) -> tuple[str, str]:
  """`(kind, path)` of a spec; raises ValueError naming it when the kind is unknown."""
  if not isinstance(spec, str):
    raise ArgumentTypeError(f"tokenizer spec must be a str such as 'hf:PATH', got {spec!r}")
  kind, sep, path = spec.partition(":")
  if not sep or kind not in KINDS or not path:
    raise ArgumentError(f"tokenizer spec {spec!r}: expected 'spm:PATH' (SentencePiece model) or "
                     f"'hf:PATH' (Hugging Face tokenizer.json)")
  return kind, path


def from_spec(spec: str) -> Tokenizer:
  """The tokenizer named by `spec` (`"spm:PATH"` or `"hf:PATH"`).

  Raises:
    ValueError: unknown kind, or the file is not a tokenizer of that kind (the message names it).
    FileNotFoundError: the file does not exist.
    ImportError: `hf:` without the `tokenizers` package (names the `segpack[hf]` extra).
  """
  kind, path = split_spec(spec)
  if kind == "spm":
    return spm_lib.SpmTokenizer(path)
  return hf_lib.HfTokenizer(path)

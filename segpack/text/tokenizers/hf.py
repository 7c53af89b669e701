"""A Hugging Face `tokenizer.json` (the `tokenizers` library, extra `segpack[hf]`) as a segpack
tokenizer.

Special ids (BOS, EOS, pad, unk), in this order of precedence:

1. `tokenizer_config.json` in the same directory, when present: its `bos_token`, `eos_token`,
   `pad_token`, `unk_token` (a string, or an AddedToken object whose `"content"` is the string),
   looked up in the tokenizer's vocabulary. A token the config names that the vocabulary lacks is
   an error (naming the file and the token), never a guess.
2. Otherwise `tokenizer.json` itself: BOS / EOS are the special tokens its `post_processor` puts
   around a single sequence (`TemplateProcessing`: the leading and trailing special tokens of the
   `single` template; `RobertaProcessing` / `BertProcessing`: `cls` and `sep`), pad is its
   `padding.pad_id`, unk the model's `unk_token` (or `unk_id`).
3. Otherwise None. Ids are not guessed from token names: a tokenizer that states no BOS/EOS
   records `bos_id: null` / `eos_id: null` in the manifest, and `segpack.pack_dataset` then refuses
   with a `PipelineConfigError` asking for `SpecialTokens(bos_id=...)` or `add_bos=False`.

Encoding matches what `segpack tokenize` stores for SentencePiece: no special tokens are added
(`add_special_tokens=False`: the packing pipeline adds BOS/EOS itself), the truncation and
padding settings saved in `tokenizer.json` are switched off (a document is never cut or padded),
and special tokens written literally in the text (e.g. `"</s>"`, or `"<s>"` in HTML) are encoded
as text (`encode_special_tokens=True`), so a document never carries an EOS id in its middle.
Added tokens that are not special still match as one token each.

The fingerprint is `"sha256:"` + the SHA-256 of `tokenizer.json`'s bytes; when a
`tokenizer_config.json` was read it is the SHA-256 of the two files' hex digests, each followed by
a newline (`f"{sha256(tokenizer.json)}\\n{sha256(tokenizer_config.json)}\\n"`), since the
config decides the special ids.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from segpack import files
from segpack import shards
from segpack.errors import ArgumentError

__all__ = ["CONFIG_NAME", "TOKENIZER_NAME", "HfTokenizer"]

CONFIG_NAME = "tokenizer_config.json"
TOKENIZER_NAME = "tokenizer.json"
_NAMES = ("bos", "eos", "pad", "unk")


def _tokenizers_module():
  """The `tokenizers` package, or an ImportError naming the extra that installs it."""
  try:
    import tokenizers  # optional: only `--tokenizer hf:...` needs it (extra segpack[hf]).
  except ImportError as e:
    raise ImportError("a Hugging Face tokenizer.json needs the `tokenizers` package: "
                      "pip install 'segpack[hf]'") from e
  return tokenizers


def _token_content(value: Any, where: str) -> str | None:
  """A config entry (a string, an AddedToken dict, or null) as the token's string."""
  if value is None:
    return None
  if isinstance(value, dict):
    value = value.get("content")
  if not isinstance(value, str) or not value:
    raise ArgumentError(f"{where}: expected a token string or an object with a \"content\" string, "
                     f"got {value!r:.100}")
  return value


def _post_processor_tokens(post: Any) -> dict[str, str]:
  """BOS / EOS token strings that a `post_processor` puts around a single sequence."""
  if not isinstance(post, dict):
    return {}
  kind = post.get("type")
  if kind == "Sequence":
    out: dict[str, str] = {}
    for inner in post.get("processors") or []:
      out.update(_post_processor_tokens(inner))
    return out
  if kind in ("RobertaProcessing", "BertProcessing"):
    out = {}
    for name, key in (("bos", "cls"), ("eos", "sep")):
      pair = post.get(key)
      if isinstance(pair, list) and pair and isinstance(pair[0], str):
        out[name] = pair[0]
    return out
  if kind == "TemplateProcessing":
    single = [p for p in post.get("single") or [] if isinstance(p, dict)]
    out = {}
    for name, piece in (("bos", single[0] if single else None),
                        ("eos", single[-1] if len(single) > 1 else None)):
      if piece is not None and "SpecialToken" in piece:
        out[name] = piece["SpecialToken"].get("id")
    return {k: v for k, v in out.items() if isinstance(v, str)}
  return {}


class HfTokenizer:
  """A Hugging Face `tokenizer.json` with segpack's conventions (see the module docstring).

  Algorithm:
    1. Load: `tokenizers.Tokenizer.from_str` of the file; truncation and padding off and special
       tokens in the text encoded as text. `vocab_size` is one more than the largest id of the
       vocabulary (added tokens included); the dtype follows it (uint16 up to 65536, else uint32).
    2. Special ids from `tokenizer_config.json` beside the file, else from `tokenizer.json`.
    3. `encode` / `encode_batch`: the ids of `encode(text, add_special_tokens=False)` as NumPy
       arrays in the shard dtype. `decode` turns every id back, special tokens included.

  Example: a BPE trained with special tokens "<s>", "</s>", "<pad>" and a config naming them
  gives `bos_id`, `eos_id`, `pad_id` = their ids, and `encode("a b")` carries neither.
  """

  def __init__(self, tokenizer_file: str | os.PathLike[str]):
    """Loads `tokenizer_file` (a `tokenizer.json`, or a Hugging Face model directory holding
    one); raises FileNotFoundError / ValueError naming it."""
    self.model_file = Path(tokenizer_file)
    if self.model_file.is_dir():  # a Hugging Face model directory: its tokenizer.json
      if not (self.model_file / TOKENIZER_NAME).is_file():
        raise FileNotFoundError(f"{str(self.model_file)!r} is a directory without a "
                                f"{TOKENIZER_NAME}; name a tokenizer.json or a model directory "
                                f"that holds one")
      self.model_file = self.model_file / TOKENIZER_NAME
    if not self.model_file.is_file():
      raise FileNotFoundError(f"tokenizer file {str(self.model_file)!r} does not exist")
    raw = self.model_file.read_bytes()
    try:
      spec = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors.
      raise ArgumentError(f"{self.model_file}: not a Hugging Face tokenizer.json (not JSON: {e})")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
      raise ArgumentError(f"{self.model_file}: not a Hugging Face tokenizer.json (no \"model\" "
                       f"object)")
    lib = _tokenizers_module()
    try:
      self._tok = lib.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # The library raises plain Exception for a malformed file.
      raise ArgumentError(f"{self.model_file}: not a Hugging Face tokenizer.json ({e})") from e
    self._tok.no_truncation()
    self._tok.no_padding()
    self._tok.encode_special_tokens = True
    self.spec = "hf:" + str(self.model_file.resolve())
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size: int = max(self._tok.get_vocab_size(with_added_tokens=True),
                               max(vocab.values(), default=-1) + 1)
    self.dtype = shards.dtype_for_vocab(self.vocab_size)
    config_path = self.model_file.parent / CONFIG_NAME
    self.config_file = config_path if config_path.is_file() else None
    ids = self._special_ids(spec)
    self.bos_id: int | None = ids["bos"]
    self.eos_id: int | None = ids["eos"]
    self.pad_id: int | None = ids["pad"]
    self.unk_id: int | None = ids["unk"]
    digest = hashlib.sha256(raw).hexdigest()
    if self.config_file is not None:
      both = f"{digest}\n{files.sha256_file(self.config_file)}\n"
      digest = hashlib.sha256(both.encode("ascii")).hexdigest()
    self.fingerprint = "sha256:" + digest

  def _special_ids(self, spec: dict[str, Any]) -> dict[str, int | None]:
    """BOS/EOS/pad/unk ids by the precedence of the module docstring."""
    tokens: dict[str, str | None] = dict.fromkeys(_NAMES)
    ids: dict[str, int | None] = dict.fromkeys(_NAMES)
    if self.config_file is not None:
      try:
        config = json.loads(self.config_file.read_text("utf-8"))
      except ValueError as e:
        raise ArgumentError(f"{self.config_file}: not valid JSON ({e})") from e
      if not isinstance(config, dict):
        raise ArgumentError(f"{self.config_file}: expected a JSON object, got {config!r:.100}")
      for name in _NAMES:
        key = f"{name}_token"
        tokens[name] = _token_content(config.get(key), f"{self.config_file}: {key}")
        if tokens[name] is not None and self._tok.token_to_id(tokens[name]) is None:
          raise ArgumentError(f"{self.config_file}: {key} {tokens[name]!r} is not in the vocabulary "
                           f"of {self.model_file}")
    post = _post_processor_tokens(spec.get("post_processor"))
    model = spec["model"]
    fallback = {"bos": post.get("bos"), "eos": post.get("eos"), "pad": None,
                "unk": model.get("unk_token") if isinstance(model.get("unk_token"), str) else None}
    padding = spec.get("padding")
    if isinstance(padding, dict) and isinstance(padding.get("pad_id"), int):
      ids["pad"] = padding["pad_id"]
    if isinstance(model.get("unk_id"), int):  # Unigram models store the id itself.
      ids["unk"] = model["unk_id"]
    for name in _NAMES:
      token = tokens[name] if tokens[name] is not None else fallback[name]
      if token is not None and (found := self._tok.token_to_id(token)) is not None:
        ids[name] = found
    return ids

  def encode(self, text: str) -> np.ndarray:
    """Token ids of `text` (no special tokens added) in the shard dtype."""
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`encode` of each text."""
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]

  def decode(self, ids: Iterable[int] | np.ndarray) -> str:
    """The text of token ids, special tokens included."""
    return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                            skip_special_tokens=False)

  def symbol_id(self, piece: str) -> int | None:
    """The id of `piece` when it is an added token (special or not), else None.

    The chat encoder (`segpack.text.chat.ChatEncoder`) puts its role markers in by this id, while
    message text goes through `encode`, where a special token written in the text stays text.
    """
    for token_id, added in self._tok.get_added_tokens_decoder().items():
      if added.content == piece:
        return int(token_id)
    return None

  def describe(self) -> dict[str, Any]:
    """JSON-ready description (the shard manifest's `metadata.tokenizer`, read back as a
    `segpack.shards.record.TokenizerRecord`)."""
    return {"type": "hf", "model_file": self.model_file.name,
            "config_file": None if self.config_file is None else self.config_file.name,
            "fingerprint": self.fingerprint, "vocab_size": self.vocab_size,
            "pad_id": self.pad_id, "unk_id": self.unk_id, "bos_id": self.bos_id,
            "eos_id": self.eos_id}

  def __repr__(self) -> str:
    return f"HfTokenizer({str(self.model_file)!r}, vocab_size={self.vocab_size})"

r"""The tokenizer and chat-template files of a Hugging Face directory that `python -m
train.export` writes (`train.export.files` writes the weights and config.json).

Tokenizer: a SentencePiece model is written as `tokenizer.model` plus a `tokenizer.json` built
with the `tokenizers` library (`spm_tokenizer`: a Unigram model of the pieces and scores, byte
fallback, spaces as "▁", the user-defined symbols as added tokens), which transformers loads
without converting anything; `tokenizer_config.json` names `PreTrainedTokenizerFast`, whose
tokenizer is that file as written (transformers 5's `LlamaTokenizer` replaces the normalizer and
pre-tokenizer of the file with Llama's own, which adds a leading "▁" segpack's SentencePiece
models do not). The characters of byte pieces' names (`<`, `x`, hex digits, `>`) that the model
otherwise lacks are split off before the Unigram model reads the text, which would otherwise read
the literal text `<0xFF>` as that byte piece (SentencePiece spells it in the bytes of `<`, `0`,
...). The conversion is checked when it is written on `PROBE_TEXTS`, `BYTE_FALLBACK_TEXTS` and the
run's first 100 documents (`run_documents`); a model trained with other settings (NFKC
normalization, a dummy prefix) is refused with an `ExportError` rather than written as a
tokenizer that encodes differently. An imported model's tokenizer files
(`WORKDIR/hf_source`) are copied as they are.

Algorithm of `write_tokenizer`:
  1. An imported model: copy its tokenizer files and read its BOS / EOS / pad ids from its
     config.json and generation_config.json (never a tokenizer default).
  2. Else the run's SentencePiece model: `tokenizer.model`, the converted `tokenizer.json`,
     `tokenizer_config.json`; the ids are the SentencePiece model's.
  3. The run's chat template (`train.runs.tokenizer.chat_renderer`, as `train.sample --chat`
     reads it), when it has one: segpack's (`exported_template`) into `tokenizer_config.json`
     and `chat_template.jinja`; the tokenizer's own (data rendered by
     `segpack.text.chat.hf_chat`, or an imported model's) keeps that template's files as they are.

Chat template: `chat_template_jinja` renders a conversation exactly as
`segpack.text.chat.ChatTemplate.render` does, after the BOS the pipeline puts first.

Example: `chat_template_jinja(ChatTemplate(), add_bos=True)` renders user "Hi", assistant "Hello"
as `<s><|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>`, and user "Hi" with
`add_generation_prompt=True` as `<s><|user|>\nHi<|end|>\n<|assistant|>\n`.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece

from segpack import errors
from segpack import files
from segpack import shards
from segpack.errors import UserError
from segpack.text import chat
from segpack.text import corpus
from segpack.text.tokenizers import hf as hf_tokenizer
from segpack.text.chat import hf_chat
from segpack.text.tokenizers import spm
from segpack.text.tokenizers import spm_proto
from train import data_sources as data_sources
from train.hf import init_from as hf_init
from train.runs.errors import NoTokenizerError
from train.runs import tokenizer as run_tokenizer

_LOG = logging.getLogger(__name__)
# Texts on which a converted SentencePiece tokenizer must give SentencePiece's own ids.
PROBE_TEXTS = ("Hello world", " leading space", "two  spaces and\ta tab", "line\nbreak\n\n  x",
               "trailing ", "def f(x):\n    return x + 1\n", "ｆｕｌｌｗｉｄｔｈ ﬁ ①",
               "e\u0301 é", "unicode ✓ 𝔘 日本語", "<0x41> literal byte piece")
# Texts spelled in byte pieces by a model that lacks their characters (a model of lowercase
# text: uppercase letters, digits, `<`, emoji), and the names of byte pieces as literal text.
BYTE_FALLBACK_TEXTS = ("<0xFF>", "<0x41><0x3C>x", "a<0xff>b <0x4> <0x1F600>", "UPPER Case 123",
                       "emoji 😀👍🏽 and ☃", "x<0xFF>\n\t<0x0A> <>", "<0x41> EOF 0xFF")
BYTE_PIECE_CHARS = "<>x0123456789ABCDEF"  # the characters of the byte pieces' names


class ExportError(UserError, ValueError):
  """A run or an output directory that cannot be exported (printed as one line, exit code 2)."""


def write_json(path: str, value: Any) -> None:
  """`value` as indented JSON (keys in their order), written through a temporary file."""
  files.atomic_write_bytes(Path(path), (json.dumps(value, indent=2) + "\n").encode("utf-8"))


def _jinja_string(text: str) -> str:
  """A Jinja string literal of `text` (JSON's escapes are Jinja's: `\\n`, `\\u2581`, ...)."""
  return json.dumps(text)


def chat_template_jinja(template: chat.ChatTemplate, *, add_bos: bool) -> str:
  """The Jinja chat template (transformers' `apply_chat_template`) rendering what `template`
  renders: `bos_token` first when the pipeline adds BOS, then every message as marker,
  `after_marker`, content and `end_of_turn`, with `after_turn` between messages;
  `add_generation_prompt` appends `after_turn` (after a message), the assistant marker and
  `after_marker`. A role other than system, user and assistant raises."""
  q = _jinja_string
  markers = (f"{{% if message['role'] == 'system' %}}{{{{ {q(template.system)} }}}}"
             f"{{% elif message['role'] == 'user' %}}{{{{ {q(template.user)} }}}}"
             f"{{% elif message['role'] == 'assistant' %}}{{{{ {q(template.assistant)} }}}}"
             f"{{% else %}}{{{{ raise_exception('segpack chat template: the roles are system, "
             f"user and assistant, got ' + message['role']) }}}}{{% endif %}}")
  return (("{{ bos_token }}" if add_bos else "") +
          "{% for message in messages %}"
          f"{{% if not loop.first %}}{{{{ {q(template.after_turn)} }}}}{{% endif %}}"
          f"{markers}{{{{ {q(template.after_marker)} + message['content'] + "
          f"{q(template.end_of_turn)} }}}}"
          "{% endfor %}"
          f"{{% if add_generation_prompt %}}{{% if messages %}}{{{{ {q(template.after_turn)} }}}}"
          f"{{% endif %}}{{{{ {q(template.assistant)} + {q(template.after_marker)} }}}}"
          "{% endif %}")


def _spm_processor(model_file: str):
  return sentencepiece.SentencePieceProcessor(model_file=str(model_file))


def _isolated_chars(sp: Any) -> str:
  """The characters of byte pieces' names (`<0x41>`) that no other piece holds: isolated before
  the Unigram model sees the text, so that it never reads the literal text `<0x41>` as that byte
  piece (SentencePiece never matches byte pieces in text; the Unigram model of `tokenizers`
  does, and prefers that to the unknown character the text holds)."""
  held = set()
  for i in range(sp.get_piece_size()):
    if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i)):
      held.update(sp.id_to_piece(i))
  return "".join(c for c in BYTE_PIECE_CHARS if c not in held)


def convert_spm(model_file: str, *, add_bos: bool, byte_fallback: bool = True) -> Any:
  """The `tokenizers.Tokenizer` of the SentencePiece model `model_file`, unchecked (see
  `spm_tokenizer`); `byte_fallback=False` leaves out the byte fallback and the isolated
  characters it needs (SentencePiece's models without byte pieces)."""
  # optional at import time: the `tokenizers` package (extra segpack[hf])
  from tokenizers import (  # optional: the [hf] extra, SentencePiece export only
      AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors)
  sp = _spm_processor(model_file)
  vocab, special = [], []
  for i in range(sp.get_piece_size()):
    # SentencePiece never matches control or byte pieces in text; a score far below every
    # other keeps the Unigram model from matching them (bytes still serve as the fallback).
    score = -1e9 if sp.is_byte(i) or sp.is_control(i) else sp.get_score(i)
    vocab.append((sp.id_to_piece(i), score))
    if sp.is_control(i) or sp.is_unknown(i):
      special.append(sp.id_to_piece(i))
  user = spm_proto.user_defined_pieces(Path(model_file).read_bytes())
  tok = Tokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=byte_fallback))
  tok.normalizer = normalizers.Replace(" ", "▁")
  isolated = _isolated_chars(sp) if byte_fallback else ""
  if isolated:  # each one an unknown character of its own, as SentencePiece reads it
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"[{isolated}]"), behavior="isolated")
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
  tok.add_tokens([AddedToken(p, special=False, normalized=False)
                  for p, _ in sorted(user.items(), key=lambda kv: kv[1])])
  if add_bos and sp.bos_id() >= 0:
    bos = sp.id_to_piece(sp.bos_id())
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, sp.bos_id())])
  return tok


def _difference(sp: Any, tok: Any, text: str, *, strict: bool) -> tuple[str, list[int],
                                                                         list[int]]:
  """`(kind, SentencePiece's ids, tok's ids)` of `text`: kind "same", "order" (the same pieces
  in another order), "special" (the same ids once the text of a special token such as `<s>` in
  it is read as text, as transformers' `split_special_tokens=True` reads it) or "differs";
  `strict`: only "same" or "differs"."""
  want, got = sp.encode(text), tok.encode(text, add_special_tokens=False).ids
  if want == got or strict:
    return ("same" if want == got else "differs"), want, got
  if sorted(want) == sorted(got):
    return "order", want, got
  tok.encode_special_tokens = True
  try:
    as_text = tok.encode(text, add_special_tokens=False).ids
  finally:
    tok.encode_special_tokens = False
  return ("special" if as_text == want else "differs"), want, got


def spm_tokenizer(model_file: str, *, add_bos: bool, texts: Sequence[str] = ()) -> Any:
  """A `tokenizers.Tokenizer` that encodes as the SentencePiece model `model_file` does (segpack's
  settings: identity normalization, no dummy prefix, byte fallback; see the module docstring),
  adding the BOS when `add_bos` (`convert_spm`).

  Two differences on `texts` (the run's own documents) are warnings naming how many: the same
  pieces in another order (segmentations of equal score, `****` as 3 + 1 or 1 + 3, which
  SentencePiece's float32 sums and `tokenizers`' float64 sums break differently), and the text
  of a special token (`<s>`) in a document, which transformers reads as that token unless
  `split_special_tokens=True`. Any other difference is refused.

  Raises:
    ExportError: it disagrees with SentencePiece on `PROBE_TEXTS`, `BYTE_FALLBACK_TEXTS` or
      `texts`: a model trained with other normalization settings.
  """
  sp = _spm_processor(model_file)
  tok = convert_spm(model_file, add_bos=add_bos)
  probes, found = set(PROBE_TEXTS + BYTE_FALLBACK_TEXTS), {"order": [], "special": []}
  for text in (*PROBE_TEXTS, *BYTE_FALLBACK_TEXTS, *texts):
    kind, want, got = _difference(sp, tok, text, strict=text in probes)
    if kind in found:
      found[kind].append(text)
    elif kind == "differs":
      at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b),
                min(len(want), len(got)))
      raise ExportError(
          f"{model_file}: the SentencePiece model encodes {text[:80]!r} as ...{want[at:at + 8]} "
          f"from token {at}, its converted tokenizer.json as ...{got[at:at + 8]}: export "
          f"converts models trained with segpack's settings (identity normalization, no dummy "
          f"prefix)")
  why = {"order": "the same pieces as SentencePiece's in another order (segmentations of "
                  "equal score, such as runs of one character, are broken differently)",
         "special": "the text of a special token (<s>, </s>, ...) becomes that token unless "
                    "transformers is told split_special_tokens=True"}
  for kind, held in found.items():
    if held:
      _LOG.warning("%d of the run's %d documents compared encode differently in tokenizer.json: "
                   "%s; e.g. %r", len(held), len(texts), why[kind], held[0][:80])
  return tok


def run_documents(config: Any, tokenizer: Any, *, count: int = 100,
                  max_tokens: int = 2048) -> list[str]:
  """The texts of the first `count` documents the run trained on (each its first `max_tokens`
  ids decoded): the datasets of `data.train`, else the built-in corpus; [] for other sources."""
  dirs = run_tokenizer.dataset_dirs(config, stage=False)
  if not dirs and config.data.source == "builtin":
    dirs = [str(corpus.ensure_builtin(size=config.data.size,
                                      cache_dir=config.data.cache_dir).train_dir)]
  texts = []
  for directory in dirs:
    source = shards.ShardSource(directory, verify="never")
    for i in range(min(count - len(texts), len(source))):
      texts.append(tokenizer.decode(np.asarray(source[i][:max_tokens])))
  return texts


def spm_tokenizer_config(model_file: str, *, add_bos: bool, model_max_length: int | None,
                         chat_template: str | None) -> dict[str, Any]:
  """`tokenizer_config.json` beside `spm_tokenizer`'s tokenizer.json: the SentencePiece model's
  special tokens by name, `add_bos_token` as the pipeline adds BOS, no EOS added to encodings
  (the pipeline's EOS ends a training document; a prompt does not end there)."""
  sp = _spm_processor(model_file)

  def piece(i: int) -> str | None:
    return sp.id_to_piece(i) if i >= 0 else None

  out = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token=piece(sp.bos_id()),
             eos_token=piece(sp.eos_id()), unk_token=piece(sp.unk_id()),
             pad_token=piece(sp.pad_id()), add_bos_token=bool(add_bos), add_eos_token=False,
             clean_up_tokenization_spaces=False)
  if model_max_length:
    out["model_max_length"] = int(model_max_length)
  if chat_template is not None:
    out["chat_template"] = chat_template
  return out


def _read_json(path: Path) -> dict[str, Any]:
  try:
    value = json.loads(path.read_text("utf-8"))
  except (OSError, ValueError) as e:
    raise ExportError(f"{path}: not readable JSON ({errors.one_line(e)})") from e
  if not isinstance(value, dict):
    raise ExportError(f"{path}: expected a JSON object, got {type(value).__name__}")
  return value


def exported_template(renderer: Any) -> chat.ChatTemplate | None:
  """The template export writes as Jinja for the run's chat renderer (`train.runs.tokenizer.
  chat_renderer`): segpack's `ChatTemplate`; None for plain text and for a tokenizer's own
  template, whose files are copied as they are."""
  return renderer.template if isinstance(renderer, chat.ChatEncoder) else None


def _special_ids(source: Path) -> dict[str, Any]:
  """bos/eos/pad ids of an imported model: config.json's, else generation_config.json's."""
  base = _read_json(source / "config.json")
  generation = (_read_json(source / "generation_config.json")
                if (source / "generation_config.json").is_file() else {})
  out = {}
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    if base.get(key) is not None:
      out[key] = base[key]
    elif generation.get(key) is not None:
      out[key] = generation[key]
  return out


def _write_chat_template(directory: Path, jinja: str | None) -> None:
  """The template as chat_template.jinja and in tokenizer_config.json (when there is one)."""
  if jinja is None:
    return
  (directory / "chat_template.jinja").write_text(jinja, encoding="utf-8")
  tokenizer_config = directory / "tokenizer_config.json"
  if tokenizer_config.is_file():
    write_json(str(tokenizer_config), dict(_read_json(tokenizer_config), chat_template=jinja))


def _copy_tokenizer(directory: Path, names: Sequence[tuple[Path, str]],
                    jinja: str | None) -> list[str]:
  """Copies tokenizer files `(path, name in directory)`; a chat template among them is replaced
  by `jinja` when there is one."""
  written = []
  for path, name in names:
    if jinja is not None and name in hf_chat.TEMPLATE_FILES:
      continue
    shutil.copyfile(path, directory / name)
    written.append(name)
  _write_chat_template(directory, jinja)
  return written + (["chat_template.jinja"] if jinja is not None else [])


def write_tokenizer(directory: Path, config: Any, *, source: Path | None,
                    template: Any) -> tuple[list[str], dict[str, Any]]:
  """The tokenizer files and the special ids config.json gets.

  An imported model's files come from `source` (`WORKDIR/hf_source`) and its ids from its
  config.json / generation_config.json; otherwise the run's tokenizer (`train.runs.tokenizer.
  tokenizer_for_run`): a SentencePiece model converted (`spm_tokenizer`), a Hugging
  Face tokenizer.json copied, or none for synthetic data (its ids only).
  """
  add_bos = bool(config.data.add_bos)
  if source is not None:
    jinja = None if template is None else chat_template_jinja(template, add_bos=add_bos)
    names = [(source / n, n) for n in hf_init.SOURCE_FILES
             if n not in ("config.json", "generation_config.json") and (source / n).is_file()]
    return _copy_tokenizer(directory, names, jinja), _special_ids(source)
  try:
    tokenizer = run_tokenizer.tokenizer_for_run(config)
  except NoTokenizerError:
    if config.data.train:  # a dataset whose manifest names no tokenizer file
      raise
    _LOG.warning("data.source=%r has no tokenizer: no tokenizer files are written",
                 config.data.source)
    return [], dict(bos_token_id=data_sources.SYNTHETIC_BOS, eos_token_id=data_sources.SYNTHETIC_EOS,
                    pad_token_id=0)
  ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_id") for k in ("bos", "eos", "pad")}
  ids = {k: int(v) for k, v in ids.items() if v is not None and v >= 0}
  add_bos = add_bos and "bos_token_id" in ids
  jinja = None if template is None else chat_template_jinja(template, add_bos=add_bos)
  if isinstance(tokenizer, hf_tokenizer.HfTokenizer):
    names = [(tokenizer.model_file, hf_tokenizer.TOKENIZER_NAME)] + (
        [(tokenizer.config_file, hf_tokenizer.CONFIG_NAME)] if tokenizer.config_file else [])
    here = tokenizer.model_file.parent  # data rendered with its own template keeps those files
    names += [(here / n, n) for n in hf_chat.COPY_NAMES if (here / n).is_file()
              and n not in (hf_tokenizer.TOKENIZER_NAME, hf_tokenizer.CONFIG_NAME)]
    return _copy_tokenizer(directory, names, jinja), ids
  if not isinstance(tokenizer, spm.SpmTokenizer):
    raise ExportError(f"the run's tokenizer {tokenizer!r} is not one export writes")
  model = str(tokenizer.model_file)
  if config.model.family == "qwen2":
    _LOG.warning("model.family='qwen2': transformers 5 reads a qwen2 directory's tokenizer.json "
                 "with Qwen2Tokenizer, whose byte-level pre-tokenizer does not fit the converted "
                 "SentencePiece model; AutoTokenizer will not encode as segpack did")
  spm_tokenizer(model, add_bos=add_bos, texts=run_documents(config, tokenizer)).save(
      str(directory / "tokenizer.json"))
  shutil.copyfile(model, directory / "tokenizer.model")
  write_json(str(directory / "tokenizer_config.json"), spm_tokenizer_config(
      model, add_bos=add_bos, chat_template=jinja,
      model_max_length=config.model.max_position_embeddings or config.packing.seq_len))
  if jinja is not None:
    (directory / "chat_template.jinja").write_text(jinja, encoding="utf-8")
  names = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
  return names + (["chat_template.jinja"] if jinja is not None else []), ids

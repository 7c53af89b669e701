"""A tokenizer's own chat template, loaded and run by transformers with the conversation's tools
and a recorded date: the rendering half of `segpack.text.chat.hf_chat.template.HfChatTemplate`."""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from segpack import errors
from segpack import files
from segpack.errors import ArgumentError
from segpack.text.chat import ChatFormatError, Conversation
from segpack.text.chat.hf_chat import reasoning
from segpack.text.chat.hf_chat.files import COPY_NAMES, TEMPLATE_FILES, json_template, sha256
from segpack.text.chat.hf_chat.files import template_file
from segpack.text.chat.hf_chat.messages import validate_conversation
from segpack.text.chat.hf_chat.options import ChatOptions
from segpack.text.tokenizers import hf

__all__ = ["TemplateRenderer"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TODAY_LOCK = threading.Lock()


def _transformers() -> tuple[Any, Any]:
  """`(transformers, its chat_template_utils)`, or an ImportError naming the extra.

  segpack takes only tokenizers and chat templates from transformers, so its advice that
  PyTorch is missing (printed by every command of an install without torch) is turned off,
  unless the user set `TRANSFORMERS_NO_ADVISORY_WARNINGS` themselves.
  """
  os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
  try:
    import jinja2  # noqa: F401  # optional: transformers renders chat templates with it
    import transformers  # optional: only a tokenizer's own chat template needs it (segpack[hf])
    from transformers.utils import chat_template_utils  # optional: as above
  except ImportError as e:
    raise ImportError(f"rendering chat data with the tokenizer's own chat template needs the "
                      f"`{e.name or 'transformers'}` package, which is not installed: pip "
                      f"install 'segpack[hf]'") from e
  return transformers, chat_template_utils


def _pattern(tokens: Sequence[str]) -> re.Pattern[str] | None:
  """A pattern matching any of `tokens`, longest first (None for no token)."""
  tokens = sorted({t for t in tokens if t.strip()}, key=len, reverse=True)
  return re.compile("|".join(map(re.escape, tokens))) if tokens else None


class TemplateRenderer:
  """A tokenizer directory's chat template (or `options.template_file`), run by transformers.

  Every render passes the conversation's `tools` and the date of `options` (`date_string`, and
  `strftime_now` answering that date), so that rendering twice gives the same text.
  """

  def __init__(self, directory: str | Path, *, options: ChatOptions | None = None):
    """Loads the tokenizer of `directory` with transformers (local files only).

    Raises:
      ValueError: no chat template, or transformers cannot load the tokenizer (naming it).
      ImportError: transformers is not installed (naming the extra).
    """
    self.directory = Path(directory)
    self.options = options or ChatOptions()
    source = template_file(self.directory)
    given = self.options.template_file
    if source is None and given is None:
      raise ArgumentError(f"{self.directory}: no chat template (chat_template.jinja, "
                          f"chat_template.json, or chat_template in {hf.CONFIG_NAME})")
    transformers, self._utils = _transformers()
    try:
      self._hf = transformers.AutoTokenizer.from_pretrained(str(self.directory),
                                                            local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ArgumentError(f"{self.directory}: transformers cannot load the tokenizer: "
                          f"{errors.one_line(e)}") from e
    self._sources = {n: self.directory / n for n in COPY_NAMES if (self.directory / n).is_file()}
    if given is not None:  # a training template of the user's own, kept as chat_template.jinja
      self._hf.chat_template = Path(given).read_text("utf-8")
      for name in TEMPLATE_FILES:
        self._sources.pop(name, None)
      self._sources[TEMPLATE_FILES[0]] = Path(given)
      self.template_file = TEMPLATE_FILES[0]
    else:
      if source.name == TEMPLATE_FILES[1]:  # transformers reads it for processors only
        self._hf.chat_template = json_template(source)
      self.template_file = source.name
    self.tokenizer = hf.HfTokenizer(self.directory)
    self.template = self._hf.get_chat_template()
    self.generation_markers = bool(_GENERATION.search(self.template))
    self.files = {n: sha256(p) for n, p in self._sources.items()}
    added = self._hf.added_tokens_decoder.values()
    self._control = _pattern([t.content for t in added if t.special] +
                             list(self._hf.all_special_tokens))
    self._markers = _pattern([t.content for t in added] + list(self._hf.all_special_tokens))
    self.tags = reasoning.ThinkTags.probe(lambda m: self._render(m, where="probe"),
                                          self._markers)

  def describe(self) -> dict[str, Any]:
    """The manifest's `metadata.chat` for data rendered by this template."""
    return {"renderer": "hf", "template_file": self.template_file,
            "template_sha256": self.files[self.template_file],
            "template_text_sha256": "sha256:" + hashlib.sha256(
                self.template.encode("utf-8")).hexdigest(),
            "generation_markers": self.generation_markers, "add_bos_eos": False,
            "files": dict(self.files), **self.options.describe()}

  def keep_files(self, output: str | Path) -> None:
    """Copies the tokenizer and template files into the dataset directory `output` (atomic per
    file; a copy already equal is kept)."""
    for name, digest in self.files.items():
      dest = Path(output) / name
      if dest.is_file() and sha256(dest) == digest:
        continue
      files.atomic_write_bytes(dest, self._sources[name].read_bytes())

  @contextlib.contextmanager
  def today(self) -> Iterator[None]:
    """While open, a template's `strftime_now` answers `options.date` (transformers gives it
    `datetime.now()`; a render must not depend on the day it runs)."""
    if "strftime_now" not in self.template:
      yield
      return
    day, utils = self.options.day, self._utils

    class _Fixed(datetime.datetime):
      @classmethod
      def now(cls, tz=None):  # noqa: ARG003  # the recorded day, in any zone
        return day

    with _TODAY_LOCK:
      saved, utils.datetime = utils.datetime, _Fixed
      try:
        yield
      finally:
        utils.datetime = saved

  def kwargs(self, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """What every render passes to the template: the tools and the date."""
    return {"tools": tools, "date_string": self.options.date_string}

  def _render(self, messages: list[dict[str, Any]], *, where: str, prompt: bool = False,
              tools: list[dict[str, Any]] | None = None) -> str:
    try:
      with self.today():
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt,
                                            **self.kwargs(tools))
    except ImportError:  # a missing package is not the data's fault
      raise
    except Exception as e:  # noqa: BLE001  # the template's raise_exception, Jinja errors
      raise ChatFormatError(f"{where}: the chat template of {self.directory} does not render "
                            f"messages[:{len(messages)}]: {errors.one_line(e)}") from e

  def _generation_spans(self, messages: list[dict[str, Any]], *,
                        tools: list[dict[str, Any]] | None) -> list[tuple[int, int]]:
    """The character spans a `{% generation %}` template marks in its render of `messages`."""
    with self.today():
      _, spans = self._utils.render_jinja_template(
          conversations=[messages], chat_template=self.template, return_assistant_tokens_mask=True,
          **self._hf.special_tokens_map, **self.kwargs(tools))
    return [tuple(s) for s in spans[0]]

  def prompt_ids(self, messages: Sequence[Mapping[str, Any]], *, where: str = "prompt",
                 tools: Any = None) -> list[int]:
    """The conversation rendered with the generation prompt (and `tools`, a list of JSON
    schemas), as token ids (the BOS included when the template writes it): what the model
    continues with an assistant answer."""
    conversation = Conversation(messages=list(messages), tools=tools)
    messages, tools = validate_conversation(conversation, where=where, train_on="all",
                                            control=self._control)
    text = self._render(messages, where=where, prompt=True, tools=tools)
    return [int(i) for i in self._hf(text, add_special_tokens=False)["input_ids"]]

  @functools.cached_property
  def stop_ids(self) -> tuple[int, ...]:
    """The EOS id and the end-of-turn token the template writes after an assistant message (the
    first special or added token after the content of a probe conversation)."""
    out = [] if self._hf.eos_token_id is None else [int(self._hf.eos_token_id)]
    probes = ([{"role": "user", "content": "Hi"}],
              [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}])
    for head in probes:
      try:
        text = self._render(head + [{"role": "assistant", "content": "Hello"}], where="stop_ids")
      except ChatFormatError:
        continue
      at = text.rfind("Hello")
      found = self._markers.search(text, at) if self._markers and at >= 0 else None
      if found is not None:
        out.append(int(self._hf.convert_tokens_to_ids(found.group())))
      break
    return tuple(dict.fromkeys(out))

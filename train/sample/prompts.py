"""The sampler's prompts (`python -m train.sample`, `train.sample.command`): the flags' checks,
`--tools` and `--conversation` files read and checked, and every prompt's token ids as the model
sees it (BOS, the run's chat template, its stop ids); `SampleError`, the command's one error.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import ml_collections

from segpack.errors import UserError
from segpack.text import chat
from segpack.text.chat import hf_chat
from segpack.text.chat.hf_chat import messages as hf_messages
from train.runs import tokenizer as run_tokenizer
from train.runs.errors import NoTokenizerError


class SampleError(UserError, ValueError):
  """A prompt or setting that cannot be sampled with (printed as one line, exit code 2); a run
  that cannot be read back is a `train.runs.errors.RunError`."""



def parse_ids(text: str) -> list[int]:
  """`"5,6,7"` -> `[5, 6, 7]`; raises SampleError naming `--prompt_ids` otherwise."""
  try:
    ids = [int(part) for part in text.split(",") if part.strip()]
  except ValueError as e:
    raise SampleError(f"--prompt_ids must be comma-separated ints, got {text!r}") from e
  if not ids:
    raise SampleError(f"--prompt_ids holds no token id, got {text!r}")
  return ids



def chat_renderer(config: ml_collections.ConfigDict, workdir: str) -> Any:
  """The run's chat template (`train.runs.tokenizer.chat_renderer`); SampleError when it has none."""
  renderer = run_tokenizer.chat_renderer(config, workdir)
  if renderer is None:
    raise SampleError("--chat needs a run on chat data (data.source='builtin_chat', a dataset "
                      "tokenized with --format chat) or an imported model with a chat template; "
                      f"this run's data is {config.data.train or config.data.source!r}")
  return renderer



def _read_json(path: str, *, flag: str) -> Any:
  """The JSON value of the file a flag names; SampleError naming the flag and the file."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise SampleError(f"{flag} {path}: cannot read it: {getattr(e, 'strerror', None) or e}") from e
  try:
    return json.loads(text)
  except ValueError as e:
    raise SampleError(f"{flag} {path}: not JSON: {e}") from e



def check_tools(tools: Any, *, where: str = "tools") -> list[dict[str, Any]]:
  """`tools` as a list of tool schemas (`segpack.text.chat.hf_chat.validate_tools`); SampleError
  naming `where` otherwise (None included)."""
  try:
    checked = hf_chat.validate_tools(tools, where=where)
  except chat.ChatFormatError as e:
    raise SampleError(str(e)) from e
  if checked is None:
    raise SampleError(f"{where}: tools must be a list of objects (JSON schemas), got None")
  return checked



def check_conversation(conversation: Any, *, where: str = "conversation") -> chat.Conversation:
  """`conversation` (a `chat.Conversation` or a list of messages) checked for a model's own
  template (`segpack.text.chat.hf_chat.validate_conversation`) and ending with a user or tool
  message, whose next assistant turn the model answers; SampleError naming `where` otherwise."""
  try:
    messages, tools = hf_chat.validate_conversation(conversation, where=where, train_on="all")
  except chat.ChatFormatError as e:
    raise SampleError(str(e)) from e
  last = messages[-1]["role"]
  if last != "user" and last not in hf_messages.TOOL_ROLES:
    raise SampleError(f"{where}: the last message has role {last!r}; end with a user or tool "
                      f"message, whose next assistant turn the model answers")
  return chat.Conversation(messages=messages, tools=tools)



def read_tools(path: str) -> list[dict[str, Any]]:
  """The tool schemas of a `--tools` file: a JSON list of objects, or an object with a `tools`
  list; SampleError naming the flag and the file otherwise."""
  value = _read_json(path, flag="--tools")
  if isinstance(value, dict):
    if "tools" not in value:
      raise SampleError(f"--tools {path}: an object without a 'tools' list; give a list of tool "
                        f"schemas or {{\"tools\": [...]}}, got keys {sorted(value)[:6]}")
    value = value["tools"]
  return check_tools(value, where=f"--tools {path}")



def read_conversation(path: str) -> chat.Conversation:
  """The conversation of a `--conversation` file: `{"messages": [...], "tools": [...]}` (tools
  optional) or a list of messages, checked as `check_conversation` does; SampleError naming the
  flag and the file otherwise."""
  value = _read_json(path, flag="--conversation")
  where = f"--conversation {path}"
  if isinstance(value, dict):
    if "messages" not in value:
      raise SampleError(f"{where}: an object without a 'messages' list; give {{\"messages\": "
                        f"[...], \"tools\": [...]}} or a list of messages, got keys "
                        f"{sorted(value)[:6]}")
    value = chat.Conversation(messages=value["messages"], tools=value.get("tools"))
  return check_conversation(value, where=where)



def check_request(*, texts: Sequence[str], ids: Sequence[str], chat_mode: bool,
                   system: str | None, conversation: chat.Conversation | None,
                   tools: Any) -> None:
  """The combinations of prompt settings that cannot be sampled with (before any file of the
  run is read)."""
  if conversation is not None and (texts or ids):
    raise SampleError(f"--conversation is the whole prompt: give it without --prompt or "
                      f"--prompt_ids, got --prompt={list(texts)!r} and "
                      f"--prompt_ids={list(ids)!r}")
  if conversation is None and bool(texts) == bool(ids):
    raise SampleError(f"give --prompt (text) or --prompt_ids (comma-separated ids), one of the "
                      f"two, got --prompt={list(texts)!r} and --prompt_ids={list(ids)!r}")
  for flag, given in (("--tools", tools is not None), ("--conversation", conversation is not None)):
    if given and not chat_mode:
      raise SampleError(f"{flag} needs --chat: the model's chat template renders it")
  if tools is not None and ids:
    raise SampleError("--tools applies to --prompt and --conversation, not to --prompt_ids "
                      "(token ids are not rendered)")
  if system and conversation is not None:
    raise SampleError("--system applies to --prompt; put the system message into the "
                      "--conversation file")



def _chat_prompts(renderer: Any, *, texts: Sequence[str], system: str | None,
                  conversation: chat.Conversation | None,
                  tools: list[dict[str, Any]] | None) -> list[list[int]]:
  """The chat prompts' token ids: each text as a user turn (after `system`), or the
  conversation; with the tools (`tools`, else the conversation's own)."""
  if (tools is not None or conversation is not None) and not isinstance(
      renderer, hf_chat.HfChatTemplate):
    flag = "--tools" if tools is not None else "--conversation"
    raise SampleError(f"{flag} needs a run whose chat template is the model's own (data "
                      f"tokenized with --tokenizer hf:DIR and its template, or an imported "
                      f"model's); this run's chat data is rendered with segpack's template, "
                      f"which has no place for tools")
  try:
    if conversation is not None:
      offered = conversation.tools if tools is None else tools
      return [renderer.prompt_ids(conversation.messages, where="--conversation", tools=offered)]
    head = [{"role": "system", "content": system}] if system else []
    offered = {} if tools is None else {"tools": tools}  # segpack's template takes no tools
    where = "--system and --prompt" if system else "--prompt"
    return [renderer.prompt_ids(head + [{"role": "user", "content": t}], where=where, **offered)
            for t in texts]
  except chat.ChatFormatError as e:  # a special token or template marker in a content
    raise SampleError(str(e)) from e



def encode_prompts(config: ml_collections.ConfigDict, workdir: str, *, texts: Sequence[str],
             ids: Sequence[str], chat_mode: bool, system: str | None,
             conversation: chat.Conversation | None = None,
             tools: list[dict[str, Any]] | None = None,
             ) -> tuple[list[list[int]], list[int], Any, int]:
  """`(token ids of every prompt as the model sees it, stop ids, tokenizer or None, the number
  of ids put before the user's own: BOS)`."""
  try:
    tokenizer = run_tokenizer.tokenizer_for_run(config)
  except NoTokenizerError as e:
    if texts or conversation is not None:
      raise SampleError(f"{e}: give the prompt as token ids, --prompt_ids=5,6,7") from e
    tokenizer = None
  bos, eos = run_tokenizer.special_ids(config, tokenizer)
  begin, stops = ([] if bos is None else [bos]), ([] if eos is None else [eos])
  if ids:
    return [begin + parse_ids(text) for text in ids], stops, tokenizer, len(begin)
  if any(not t for t in texts):
    raise SampleError(f"--prompt must be non-empty text, got {list(texts)!r}")
  if not chat_mode:
    return ([begin + [int(i) for i in tokenizer.encode(t)] for t in texts], stops, tokenizer,
            len(begin))
  renderer = chat_renderer(config, workdir)
  prompts = _chat_prompts(renderer, texts=texts, system=system, conversation=conversation,
                          tools=tools)
  if isinstance(renderer, chat.ChatEncoder):  # segpack's template: the pipeline added BOS
    prompts = [begin + p for p in prompts]
  return prompts, sorted(set(stops) | set(renderer.stop_ids)), tokenizer, 0



def check_room(ids: Sequence[Sequence[int]], *, seq_len: int, flag: str) -> None:
  """Every prompt leaves room for a new token in the model's positions (the run's rows)."""
  for p, prompt in enumerate(ids):
    if len(prompt) >= seq_len:
      raise SampleError(f"{flag}: prompt {p + 1} is {len(prompt)} tokens as the model sees it, "
                        f"no room for a new one in the run's {seq_len} positions "
                        f"(packing.seq_len): shorten it")

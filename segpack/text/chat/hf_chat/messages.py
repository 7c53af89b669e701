"""The checks of one conversation for a model's own chat template: messages, tools, tool calls,
tool results and reasoning.

The template decides what it renders (any role, any extra key is passed on); what is refused here
is what no template can render sensibly and what would otherwise be trained wrong in silence: a
`tools` value that is not a list of JSON schemas, a tool call without a name, a tool result that
answers no call, a reasoning trace that is not text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from segpack.errors import ArgumentError
from segpack.text import chat
from segpack.text.chat import ChatFormatError

__all__ = ["REASONING_FIELDS", "TOOL_ROLES", "validate_conversation", "validate_hf_messages",
           "validate_tools"]

# The keys of an assistant message holding its reasoning (transformers reads `reasoning_content`
# and fills it from the other two).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The roles of a message holding a tool's result.
TOOL_ROLES = ("tool", "ipython", "tool_results")


def validate_tools(tools: Any, *, where: str) -> list[dict[str, Any]] | None:
  """A conversation's `tools`: None, or a list of objects (JSON schemas); a JSON string of such a
  list (as Hugging Face datasets often store them) is read.

  Raises:
    ChatFormatError: naming `where` and the value.
  """
  if tools is None:
    return None
  if isinstance(tools, str):
    try:
      tools = json.loads(tools)
    except ValueError as e:
      raise ChatFormatError(f"{where}: tools must be a list of objects (JSON schemas), got a "
                            f"string that is not JSON: {tools!r:.80}") from e
  if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
    raise ChatFormatError(f"{where}: tools must be a list of objects (JSON schemas), got "
                          f"{tools!r:.80}")
  return tools


def _call_name(call: Any) -> Any:
  """The function name of one `tool_calls` entry (`{"function": {"name": ...}}` or `{"name":
  ...}`), or None."""
  if not isinstance(call, dict):
    return None
  function = call.get("function")
  return function.get("name") if isinstance(function, dict) else call.get("name")


def _check_message(message: dict[str, Any], *, at: str, called: bool) -> bool:
  """Checks the tool calls, tool result and reasoning of one message; returns whether a tool
  result may follow it (it is an assistant message with calls, or a result itself)."""
  role = message["role"]
  calls = message.get("tool_calls")
  if calls is not None:
    if role != "assistant" or not isinstance(calls, list) or not calls:
      raise ChatFormatError(f"{at} (role {role!r}): tool_calls must be a non-empty list on an "
                            f"assistant message, got {calls!r:.80}")
    for i, call in enumerate(calls):
      name = _call_name(call)
      if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{at} (role 'assistant'): tool_calls[{i}] has no function name "
                              f"(function.name), got {call!r:.80}")
  if role in TOOL_ROLES and not called:
    raise ChatFormatError(f"{at} (role {role!r}): a tool result with no tool call before it "
                          f"(an assistant message with tool_calls)")
  for key in REASONING_FIELDS:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
      raise ChatFormatError(f"{at} (role {role!r}): {key} must be a string, got "
                            f"{type(value).__name__}: {value!r:.80}")
  return bool(calls) or (role in TOOL_ROLES and called)


def validate_hf_messages(messages: Any, *, where: str, train_on: str = "assistant",
                         control: re.Pattern[str] | None = None) -> list[dict[str, Any]]:
  """Checks one conversation's messages for a model's own template; returns them as dicts.

  Any role and any extra key (`tool_calls`, `name`, `tool_call_id`, ...) is passed on: the
  template decides what it renders or refuses. Refused here: not a non-empty list of objects, a
  role that is not a non-empty string, a content that is not a string (null only for an assistant
  message with `tool_calls`), a content holding a control token (`control`: the tokenizer would
  read it as a turn boundary), a tool call without a name, a tool result (role `tool`) with no
  call before it, a reasoning (`reasoning_content`) that is not a string, and no assistant
  message unless `train_on="all"`.

  Raises:
    ChatFormatError: naming `where`, the message index, its role and the field.
  """
  if train_on not in chat.TRAIN_ON:
    raise ArgumentError(f"train_on must be one of {chat.TRAIN_ON}, got {train_on!r}")
  if not isinstance(messages, list) or not messages:
    raise ChatFormatError(f"{where}: messages must be a non-empty list, got {messages!r:.80}")
  called = False
  for k, message in enumerate(messages):
    at = f"{where}: messages[{k}]"
    if not isinstance(message, dict):
      raise ChatFormatError(f"{at} must be an object with role and content, got {message!r:.80}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
      raise ChatFormatError(f"{at}: role must be a non-empty string, got {role!r:.80}")
    content = message.get("content")
    if content is None:
      if role != "assistant" or not message.get("tool_calls"):
        raise ChatFormatError(f"{at} (role {role!r}): content must be a string (null only for "
                              f"an assistant message with tool_calls), got None")
    elif not isinstance(content, str):
      raise ChatFormatError(f"{at} (role {role!r}): content must be a string, got "
                            f"{type(content).__name__}: {content!r:.80}")
    elif control is not None and (found := control.search(content)):
      raise ChatFormatError(f"{at} (role {role!r}): content contains the special token "
                            f"{found.group()!r}, which the tokenizer reads as a control token")
    if message.get("tool_calls"):
      _no_control(json.dumps(message["tool_calls"], ensure_ascii=False), control,
                  at=f"{at} (role {role!r}): tool_calls")
    called = _check_message(message, at=at, called=called)
  if train_on != "all" and not any(m.get("role") == "assistant" for m in messages):
    raise ChatFormatError(f"{where}: no assistant message, so nothing would be trained with "
                          f"train_on={train_on!r}")
  return [dict(m) for m in messages]


def validate_conversation(conversation: Any, *, where: str, train_on: str = "assistant",
                          control: re.Pattern[str] | None = None,
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
  """`(messages, tools)` of a conversation given as its messages or as a `chat.Conversation`
  (`validate_hf_messages`, `validate_tools`)."""
  tools = None
  if isinstance(conversation, chat.Conversation):
    tools = validate_tools(conversation.tools, where=where)
    conversation = conversation.messages
  for k, tool in enumerate(tools or ()):  # a schema is rendered into the prompt as text too
    _no_control(json.dumps(tool, ensure_ascii=False), control, at=f"{where}: tools[{k}]")
  return validate_hf_messages(conversation, where=where, train_on=train_on, control=control), tools


def _no_control(text: str, control: re.Pattern[str] | None, *, at: str) -> None:
  """Refuses `text` (rendered into the prompt) holding one of the tokenizer's control tokens."""
  if control is not None and (found := control.search(text)):
    raise ChatFormatError(f"{at} contains the special token {found.group()!r}, which the "
                          f"tokenizer reads as a control token")

"""Chat data: conversations to tokens plus a per-token loss mask, and preference pairs.

Modules: `template` (segpack's chat template, `ChatEncoder`, the conversation checks; its names
are re-exported here), `files` (conversations read from JSONL and written as a shard dataset),
`write` (`segpack tokenize --format chat`), `corpus` (the built-in chat corpus); sub-packages
`hf_chat` (a tokenizer's own chat template, run by transformers) and `preference` (`--format
preference`).
"""

from segpack.text.chat.template import DEFAULT_TEMPLATE, ROLES, TRAIN_ON, ChatEncoder
from segpack.text.chat.template import ChatFormatError, ChatTemplate, Conversation, Encoded
from segpack.text.chat.template import Skipped, check_text, validate_messages

__all__ = ["ChatEncoder", "ChatFormatError", "ChatTemplate", "Conversation", "DEFAULT_TEMPLATE",
           "Encoded", "ROLES", "Skipped", "TRAIN_ON", "check_text", "validate_messages"]

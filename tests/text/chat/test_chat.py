"""Tests of segpack.text.chat (template, loss masks, train_on modes, validation), the chat corpus
and the loss-mask files of the shard format."""

import json

import numpy as np
import pytest

from segpack.cli import tokenize as tokenize_cli
from segpack.text import dataset
from segpack.text import chat
from segpack.text.chat import files as chat_files
from segpack.text.chat import corpus as chat_corpus
from segpack import shards
from segpack.text.tokenizers import spm

T = chat.DEFAULT_TEMPLATE


class CharTokenizer:
  """One token per character (id = code point + 10); the markers are symbols 1000, 1001, ..."""

  vocab_size = 2000
  fingerprint = "char-tokenizer"

  def __init__(self, markers_as_symbols=True):
    self._symbols = ({m: 1000 + i for i, m in enumerate(T.markers)} if markers_as_symbols
                     else {})

  def encode(self, text):
    return np.asarray([ord(c) + 10 for c in text], dtype=np.int64)

  def symbol_id(self, piece):
    return self._symbols.get(piece)


SYS, USER, ASSIST, END = 1000, 1001, 1002, 1003


def ids(text):
  return [ord(c) + 10 for c in text]


def naive(messages, train_on):
  """Reference rendering, written out turn by turn from the documented template."""
  out_ids, out_mask = [], []
  assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
  for k, m in enumerate(messages):
    marker = {"system": SYS, "user": USER, "assistant": ASSIST}[m["role"]]
    on = train_on == "all" or (m["role"] == "assistant" and (
        train_on == "assistant" or k == assistants[-1]))
    head = [marker] + ids("\n")
    body = ids(m["content"]) + [END]
    out_ids += head + body
    out_mask += [int(train_on == "all")] * len(head) + [int(on)] * len(body)
    if k + 1 < len(messages):
      out_ids += ids("\n")
      out_mask += [int(train_on == "all")]
  return out_ids, out_mask


CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye?"},
        {"role": "assistant", "content": "Bye"}]


@pytest.mark.parametrize("train_on", chat.TRAIN_ON)
def test_encode_matches_the_turn_by_turn_reference(train_on):
  enc = chat.ChatEncoder(CharTokenizer(), train_on=train_on)
  got_ids, got_mask = enc.encode(CONV)
  want_ids, want_mask = naive(CONV, train_on)
  assert got_ids.tolist() == want_ids
  assert got_mask.tolist() == want_mask
  assert got_mask.dtype == np.uint8


def test_assistant_mask_covers_exactly_the_answers_and_their_end_markers():
  enc = chat.ChatEncoder(CharTokenizer())
  got_ids, got_mask = enc.encode(CONV)
  trained = got_ids[got_mask == 1].tolist()
  assert trained == ids("Hello") + [END] + ids("Bye") + [END]
  last = chat.ChatEncoder(CharTokenizer(), train_on="last_assistant").encode(CONV)
  assert last[0][last[1] == 1].tolist() == ids("Bye") + [END]
  # The conversation ends with the last assistant turn's end marker (the EOS after it trains).
  assert got_ids[-1] == END and got_mask[-1] == 1


def test_markers_fall_back_to_text_and_strict_refuses():
  enc = chat.ChatEncoder(CharTokenizer(markers_as_symbols=False))
  got_ids, got_mask = enc.encode(CONV[1:3])
  assert got_ids.tolist() == (ids("<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>"))
  assert got_ids[got_mask == 1].tolist() == ids("Hello<|end|>")
  assert not enc.markers_are_symbols
  with pytest.raises(ValueError, match="not a special symbol"):
    chat.ChatEncoder(CharTokenizer(markers_as_symbols=False), strict_markers=True)


def test_render_and_custom_template():
  tpl = chat.ChatTemplate(system="[S]", user="[U]", assistant="[A]", end_of_turn="[E]",
                          after_marker=": ", after_turn="")
  assert tpl.render(CONV[1:3]) == "[U]: Hi[E][A]: Hello[E]"
  with pytest.raises(ValueError, match="distinct"):
    chat.ChatTemplate(user="[A]", assistant="[A]")


@pytest.mark.parametrize("messages, match", [
    ({"role": "user"}, "non-empty list"),
    ([], "non-empty list"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\]: role must be one of"),
    ([{"role": "user", "content": 3}], r"messages\[0\] \(role 'user'\): content must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
     r"messages\[1\]: role 'system' is only allowed as the first"),
    ([{"role": "user", "content": "a <|end|> b"}, {"role": "assistant", "content": "x"}],
     "contains the template marker '<\\|end\\|>'"),
    ([{"role": "user", "content": "a", "name": "bob"}], r"unsupported field\(s\) \['name'\]"),
    ([{"role": "user", "content": "a"}], "no assistant message"),
])
def test_bad_messages_are_named(messages, match):
  with pytest.raises(chat.ChatFormatError, match="chats.jsonl:7"):
    chat.validate_messages(messages, where="chats.jsonl:7")
  with pytest.raises(chat.ChatFormatError, match=match):
    chat.validate_messages(messages, where="chats.jsonl:7")


def test_all_mode_accepts_a_conversation_without_assistant():
  out = chat.validate_messages([{"role": "user", "content": "a"}], where="x", train_on="all")
  assert out == [{"role": "user", "content": "a"}]
  with pytest.raises(ValueError, match="train_on must be one of"):
    chat.ChatEncoder(CharTokenizer(), train_on="assistants")


def test_read_conversations_names_file_and_line(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"messages": CONV}) + "\n\n" + '{"text": "x"}\n')
  it = chat_files.read_conversations(path)
  where, messages = next(it)
  assert where == f"{path}:1" and messages == CONV
  with pytest.raises(chat.ChatFormatError, match=r"c.jsonl:3: no field 'messages'"):
    next(it)
  bad = tmp_path / "d.jsonl"
  bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
  enc = chat.ChatEncoder(CharTokenizer())
  with pytest.raises(chat.ChatFormatError, match=r"d.jsonl:1: no assistant message"):
    chat_files.write_chat_dataset(chat_files.read_conversations(bad), tmp_path / "out", encoder=enc)


def test_shards_carry_the_mask(tmp_path):
  enc = chat.ChatEncoder(CharTokenizer())
  convs = [CONV, CONV[1:3], CONV[:3]]
  chat_files.write_chat_dataset(((f"c{i}", c) for i, c in enumerate(convs)), tmp_path / "ds",
                          encoder=enc, shard_tokens=40)
  src = shards.ShardSource(tmp_path / "ds")
  assert src.has_loss_mask and len(src) == 3 and src.num_shards >= 2
  for i, c in enumerate(convs):
    want_ids, want_mask = naive(c, "assistant")
    assert src[i].tolist() == want_ids
    assert src.loss_mask(i).tolist() == want_mask
    assert not src.loss_mask(i).flags.writeable
  src.verify()
  meta = src.manifest["metadata"]["chat"]
  assert meta["train_on"] == "assistant" and meta["markers_are_symbols"]


def test_mask_files_are_checked(tmp_path):
  with shards.ShardWriter(tmp_path / "ds", vocab_size=100, tokenizer_fingerprint="t",
                          loss_mask=True) as w:
    w.write([5, 6, 7], loss_mask=[0, 1, 1])
    with pytest.raises(ValueError, match=r"loss_mask has shape \(2,\), the tokens \(3,\)"):
      w.write([5, 6, 7], loss_mask=[0, 1])
    with pytest.raises(ValueError, match="must be 0 or 1, got 2"):
      w.write([5, 6], loss_mask=[0, 2])
    with pytest.raises(ValueError, match="pass loss_mask"):
      w.write([5, 6])
  src = shards.ShardSource(tmp_path / "ds")
  assert src.loss_mask(0).tolist() == [0, 1, 1]
  mask_file = tmp_path / "ds" / src.manifest["shards"][0]["mask"]
  fingerprint = src.fingerprint
  mask_file.write_bytes(b"\x00\x01\x02")  # Same size, bad value and checksum.
  with pytest.raises(shards.ShardFormatError, match="checksum mismatch"):
    shards.ShardSource(tmp_path / "ds").verify()
  mask_file.write_bytes(b"\x00\x01")
  with pytest.raises(shards.ShardFormatError, match=r"mask file is 2 bytes .* 3 tokens"):
    shards.ShardSource(tmp_path / "ds")
  mask_file.unlink()
  with pytest.raises(shards.ShardFormatError, match="mask file listed in the manifest is missing"):
    shards.ShardSource(tmp_path / "ds")
  # A plain dataset with the same tokens has another fingerprint (the mask is part of it).
  with shards.ShardWriter(tmp_path / "plain", vocab_size=100, tokenizer_fingerprint="t") as w:
    w.write([5, 6, 7])
  plain = shards.ShardSource(tmp_path / "plain")
  assert not plain.has_loss_mask and plain.fingerprint != fingerprint
  with pytest.raises(shards.ShardFormatError, match="has no loss mask"):
    plain.loss_mask(0)


@pytest.fixture(scope="module")
def builtin_chat(tmp_path_factory):
  cache = tmp_path_factory.getbasetemp() / "segpack-chat-cache"
  return chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache), cache


def test_builtin_chat_corpus(builtin_chat):
  ds, cache = builtin_chat
  tok = spm.SpmTokenizer(ds.spm_model)
  for marker in T.markers:
    i = tok.symbol_id(marker)
    assert i is not None and tok.encode(f"x{marker}y").tolist().count(i) == 1
  assert tok.symbol_id("the") is None
  train, held = shards.ShardSource(ds.train_dir), shards.ShardSource(ds.eval_dir)
  assert len(train) > 300 and len(held) > 0 and train.has_loss_mask
  # Held-out answers never appear in training conversations.
  train_text = ds.train_jsonl.read_text("utf-8")
  for line in ds.eval_jsonl.read_text("utf-8").splitlines():
    answer = json.loads(line)["messages"][-1]["content"]
    assert json.dumps(answer, ensure_ascii=False)[1:-1] not in train_text
  # Tokens decode to the rendered conversation; mask 1 exactly on assistant contents + ends.
  convs = [json.loads(x) for x in ds.train_jsonl.read_text("utf-8").splitlines()]
  assert any(m["role"] == "system" for c in convs for m in c["messages"])
  assert any(sum(m["role"] == "assistant" for m in c["messages"]) > 1 for c in convs)
  for i in (0, 5, len(convs) - 1):
    messages = convs[i]["messages"]
    assert tok.decode(train[i]) == T.render(messages)
    trained = tok.decode(train[i][train.loss_mask(i) == 1])
    assert trained == "".join(m["content"] + T.end_of_turn for m in messages
                              if m["role"] == "assistant")
  again = chat_corpus.ensure_builtin_chat(size="small", cache_dir=cache)
  assert again == ds
  assert shards.ShardSource(again.train_dir).fingerprint == train.fingerprint


def test_tokenize_cli_writes_the_mask(builtin_chat, tmp_path):
  ds, _ = builtin_chat
  # Auto-detected from the `messages` field; equal to the corpus's own dataset.
  assert tokenize_cli.main(["--input", str(ds.train_jsonl), "--output", str(tmp_path / "a"),
                        "--spm-model", str(ds.spm_model), "--no-progress", "--workers", "1"]) == 0
  got, want = shards.ShardSource(tmp_path / "a"), shards.ShardSource(ds.train_dir)
  assert got.has_loss_mask and got.fingerprint == want.fingerprint
  assert tokenize_cli.main(["--input", str(ds.train_jsonl), "--output", str(tmp_path / "b"),
                        "--spm-model", str(ds.spm_model), "--no-progress", "--format", "chat",
                        "--train-on", "all"]) == 0
  every = shards.ShardSource(tmp_path / "b")
  assert all(every.loss_mask(i).all() for i in range(0, len(every), 50))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"messages": [{"role": "user", "content": "a"}]}\n'
                 '{"messages": [{"role": "assistant", "content": 5}]}\n')
  with pytest.raises(chat.ChatFormatError, match=r"bad.jsonl:1: no assistant message"):
    dataset.tokenize_files([bad], tmp_path / "c", spm_model=ds.spm_model, input_format="chat")


def test_masked_writer_resumes_byte_identically(tmp_path):
  enc = chat.ChatEncoder(CharTokenizer())
  convs = [(f"c{i}", CONV[: 3 + (i % 3)]) for i in range(12)]

  def failing():
    for k, item in enumerate(convs):
      if k == 9:
        raise KeyboardInterrupt
      yield item

  with pytest.raises(KeyboardInterrupt):
    chat_files.write_chat_dataset(failing(), tmp_path / "a", encoder=enc, shard_tokens=100,
                            resume_key="k")
  kept = sorted(p.name for p in (tmp_path / "a").glob("shard-*.mask"))
  assert kept  # finished shards (with their masks) survive the interruption
  stamps = {n: (tmp_path / "a" / n).stat().st_mtime_ns for n in kept}
  chat_files.write_chat_dataset(iter(convs), tmp_path / "a", encoder=enc, shard_tokens=100,
                          resume_key="k")
  assert stamps == {n: (tmp_path / "a" / n).stat().st_mtime_ns for n in kept}  # not rewritten
  chat_files.write_chat_dataset(iter(convs), tmp_path / "b", encoder=enc, shard_tokens=100,
                          resume_key="k")
  a, b = shards.ShardSource(tmp_path / "a"), shards.ShardSource(tmp_path / "b")
  assert a.fingerprint == b.fingerprint and a.num_shards > len(kept)
  a.verify()

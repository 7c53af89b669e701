"""The dataset record (segpack/shards/record.py), the one reading and writing of a manifest's
metadata.

Oracles: the manifests `segpack tokenize` writes, read as plain JSON. Every one (plain text with a
SentencePiece model or a Hugging Face tokenizer; chat with segpack's template or the tokenizer's
own) reads back into a record whose typed fields are the JSON's values, with nothing the writers
write left untyped, and writes back the same bytes. A field of the wrong type is refused in one
line naming the manifest and the key, by every reader; keys the record does not know survive a
rewrite in their place.
"""

import dataclasses
import json
import pickle
import shutil

import pytest

from segpack import pack_dataset
from segpack.errors import ArgumentError
from segpack.shards import MANIFEST_NAME, ShardFormatError, ShardSource, ShardWriter
from segpack.shards.record import ChatRecord, DatasetRecord, TokenizerRecord, stored_metadata
from support import chat_datasets

transformers = pytest.importorskip("transformers")

from segpack.text.chat import hf_chat  # noqa: E402
from train.runs import tokenizer as run_tokenizer  # noqa: E402
from train.runs.errors import RunError  # noqa: E402
from configs import packed  # noqa: E402

KINDS = ("spm text", "hf text", "spm chat", "segpack chat", "own chat")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
  """One dataset of each kind `segpack tokenize` writes, by name (`KINDS`)."""
  root = tmp_path_factory.mktemp("datasets")
  model = chat_datasets.spm_model(root / "spm")
  own = chat_datasets.hf_tokenizer(root / "own", template=chat_datasets.OWN_TEMPLATE)
  plain = chat_datasets.hf_tokenizer(root / "plain")
  texts = chat_datasets.write_texts(root / "texts.jsonl")
  chats = chat_datasets.write_chats(root / "chats.jsonl")
  made = {
      "spm text": (texts, "--tokenizer", f"spm:{model}"),
      "hf text": (texts, "--tokenizer", f"hf:{plain}"),
      "spm chat": (chats, "--spm-model", str(model), "--format", "chat"),
      "segpack chat": (chats, "--tokenizer", f"hf:{own}", "--chat-template", "segpack"),
      "own chat": (chats, "--tokenizer", f"hf:{own}"),
  }
  return {name: chat_datasets.tokenize(inputs, root / name.replace(" ", "_"), *flags)
          for name, (inputs, *flags) in made.items()}


def _manifest(dataset):
  return json.loads((dataset / MANIFEST_NAME).read_text("utf-8"))


@pytest.mark.parametrize("kind", KINDS)
def test_every_manifest_tokenize_writes_round_trips_through_the_record(datasets, kind):
  manifest = _manifest(datasets[kind])
  meta = manifest["metadata"]
  record = DatasetRecord.from_manifest(manifest, where=datasets[kind] / MANIFEST_NAME)
  # Written back: the same keys, values and order, so the same bytes (and metadata_sha256).
  assert json.dumps(record.to_metadata()) == json.dumps(meta)
  assert stored_metadata(meta, where="m") == meta
  # Typed: every key the writers put in the tokenizer and chat parts is a field of the record.
  assert not record.tokenizer.extra and set(meta["tokenizer"]) <= set(TokenizerRecord.FIELDS)
  for key, value in meta["tokenizer"].items():
    assert getattr(record.tokenizer, key) == value, key
  if "chat" in meta:
    assert not record.chat.extra and set(meta["chat"]) <= set(ChatRecord.FIELDS)
    for key, value in meta["chat"].items():
      assert getattr(record.chat, key) == value, key
    assert record.chat.own_template == (kind == "own chat")
    assert record.chat.adds_bos_eos == (kind != "own chat")
  else:
    assert record.chat is None
  assert set(record.extra) == set(meta) - {"tokenizer", "chat"}
  # The opened dataset carries the same record, which survives pickling (Grain workers).
  source = ShardSource(datasets[kind])
  assert source.record == record and pickle.loads(pickle.dumps(source)).record == record
  assert record.special_id("bos_id") == meta["tokenizer"]["bos_id"]


def test_the_same_template_renders_alike_and_different_ones_do_not(datasets):
  renderings = {kind: DatasetRecord.from_manifest(_manifest(datasets[kind]), where="m")
                .chat.rendering for kind in ("spm chat", "segpack chat", "own chat")}
  assert renderings["spm chat"] == renderings["segpack chat"]  # segpack's default template
  assert renderings["own chat"] != renderings["segpack chat"]
  changed = DatasetRecord.from_metadata(
      {"chat": {"renderer": "segpack", "template": {"user": "<u>"}, "train_on": "all"}},
      where="m").chat.rendering
  assert changed != renderings["segpack chat"]


# (dataset, the key refused, an edit of the metadata that gives that key a wrong type)
WRONG = [
    ("hf text", "metadata.tokenizer.bos_id", lambda m: m["tokenizer"].update(bos_id="1")),
    ("spm text", "metadata.tokenizer.fingerprint",
     lambda m: m["tokenizer"].update(fingerprint=5)),
    ("spm text", "metadata.tokenizer", lambda m: m.update(tokenizer="spm.model")),
    ("own chat", "metadata.chat.add_bos_eos", lambda m: m["chat"].update(add_bos_eos="false")),
    ("own chat", "metadata.chat.files", lambda m: m["chat"]["files"].update(x=1)),
    ("segpack chat", "metadata.chat.trained_tokens_by_role",
     lambda m: m["chat"]["trained_tokens_by_role"].update(assistant=2.5)),
    ("segpack chat", "metadata.chat.template", lambda m: m["chat"].update(template=["<|user|>"])),
    ("segpack chat", "metadata.chat", lambda m: m.update(chat=[])),
    ("hf text", "metadata.eos_id", lambda m: m.update(eos_id=True)),
    ("hf text", "metadata", lambda m: ["not", "an", "object"]),
]


@pytest.mark.parametrize("kind,key,edit", WRONG, ids=[f"{k}:{key}" for k, key, _ in WRONG])
def test_a_wrong_typed_field_is_refused_naming_the_manifest_and_the_key(datasets, tmp_path, kind,
                                                                         key, edit):
  dataset = tmp_path / "data"
  shutil.copytree(datasets[kind], dataset)
  chat_datasets.edit_metadata(dataset, edit)
  path = dataset / MANIFEST_NAME
  with pytest.raises(ShardFormatError) as opened:
    ShardSource(dataset)
  message = str(opened.value)
  assert "\n" not in message and message.startswith(f"{path}: {key} must be "), message
  # Every reader says the same: packing, the chat renderer, the run's tokenizer.
  with pytest.raises(ShardFormatError) as packing:
    pack_dataset(str(dataset), seq_len=64)
  assert str(packing.value) == message
  with pytest.raises(hf_chat.DatasetRendererError) as rendered:
    hf_chat.for_dataset(dataset)
  assert str(rendered.value) == message
  config = packed.get_config("smoke")
  config.data.train = str(dataset)
  with pytest.raises(RunError) as run:
    run_tokenizer.tokenizer_for_run(config)
  assert message in str(run.value)


def test_the_writer_refuses_a_wrong_typed_field_before_writing(tmp_path):
  out = tmp_path / "data"
  with pytest.raises(ShardFormatError, match=rf"^{out / MANIFEST_NAME}: metadata\.tokenizer\."
                                             r"eos_id must be an int or null, got 2\.0$"):
    ShardWriter(out, vocab_size=10, tokenizer_fingerprint="t",
                metadata={"tokenizer": {"bos_id": 1, "eos_id": 2.0}})
  assert not out.exists()


def test_unknown_keys_and_nulls_survive_a_rewrite_in_their_place(tmp_path):
  meta = {"zz_newer": {"b": [1, {"c": None}], "a": 2}, "tokenizer": {"hint": "x", "bos_id": 1,
          "config_file": None, "eos_id": 2}, "inputs": ["a.jsonl"], "pad_id": None,
          "chat": {"renderer": "segpack", "later": True, "train_on": "all"}}
  with ShardWriter(tmp_path / "data", vocab_size=10, tokenizer_fingerprint="t",
                   metadata=meta) as writer:
    writer.write([3, 4])
    # A writer replacing a part (as `write_chat_dataset` adds its counts) keeps the rest.
    writer.metadata = stored_metadata(writer.metadata, where="m", chat=dict(
        meta["chat"], skipped_conversations=0))
  record = ShardSource(tmp_path / "data").record
  assert record.extra["zz_newer"] == {"b": (1, {"c": None}), "a": 2}
  assert record.tokenizer.extra == {"hint": "x"} and record.chat.extra == {"later": True}
  want = dict(meta, chat=dict(meta["chat"], skipped_conversations=0))
  assert record.to_metadata() == want == _manifest(tmp_path / "data")["metadata"]
  # Read from memory, every key keeps its place (the manifest file sorts them anyway).
  record = DatasetRecord.from_metadata(want, where="m")
  assert json.dumps(record.to_metadata()) == json.dumps(want)
  # A record changed field by field writes the new value in the old key's place.
  renamed = dataclasses.replace(record, tokenizer=dataclasses.replace(record.tokenizer, eos_id=9))
  assert list(renamed.to_metadata()["tokenizer"]) == ["hint", "bos_id", "config_file", "eos_id"]
  assert renamed.to_metadata()["tokenizer"]["eos_id"] == 9


def test_the_record_is_frozen(datasets):
  record = ShardSource(datasets["own chat"]).record
  with pytest.raises(dataclasses.FrozenInstanceError):
    record.chat = None
  with pytest.raises(TypeError):
    record.chat.files["tokenizer.json"] = "sha256:0"
  with pytest.raises(TypeError):
    record.extra["inputs"] = ()


def test_special_ids_the_metadata_own_key_first_then_the_tokenizers():
  record = DatasetRecord.from_metadata(
      {"bos_id": 7, "tokenizer": {"bos_id": 2, "eos_id": 3}}, where="m")
  assert [record.special_id(n) for n in ("bos_id", "eos_id", "pad_id")] == [7, 3, None]
  assert DatasetRecord.from_metadata(None, where="m") == DatasetRecord()
  with pytest.raises(ArgumentError, match="special_id: name must be one of"):
    record.special_id("unk")
  with pytest.raises(ShardFormatError, match="^m: corrupt manifest, expected an object, got list"):
    DatasetRecord.from_manifest([], where="m")

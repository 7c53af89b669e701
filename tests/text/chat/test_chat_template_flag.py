"""`segpack tokenize --chat-template {auto,own,segpack}` (segpack/text/dataset.py): which template
renders chat data when the tokenizer has one of its own, what the manifest records, how packing,
the sampler's renderer and export read it, resuming, and the refusals.

The tokenizer is `hf_models.make_tokenizer`'s word-level one (no download): segpack's four chat
markers are its added tokens 154..157 and `w<i>` is id `i + 4`, so the ids segpack's template gives
are written out here by hand (`segpack_ids`) as the oracle, besides `chat.ChatEncoder` itself. Its
own template (`OWN`) writes the BOS first, which segpack's never does.
"""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from configs import packed  # noqa: E402
from segpack import pack_dataset  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.data import sources  # noqa: E402
from segpack.errors import UserError  # noqa: E402
from segpack.shards import ShardSource  # noqa: E402
from segpack.text import chat  # noqa: E402
from segpack.text import dataset  # noqa: E402
from segpack.text.chat import hf_chat  # noqa: E402
from segpack.text.inputs import InputFormatError  # noqa: E402
from segpack.text.tokenizers import hf  # noqa: E402
from train.export import tokenizer as hf_export_tokenizer  # noqa: E402
from train.runs import tokenizer as run_tokenizer  # noqa: E402
from support import hf_models  # noqa: E402

OWN = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' }} {{ m['content'] }} "
       "{{ '<|end|>' }} {% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }} "
       "{% endif %}")
SYSTEM, USER, ASSISTANT, END = 154, 155, 156, 157  # hf_models.CHAT_MARKERS, in order
BOS, EOS = 1, 2
CONVERSATIONS = [
    [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}],
    [{"role": "system", "content": "w10 w11"}, {"role": "user", "content": "w5"},
     {"role": "assistant", "content": "w6 w7 w8"}],
    [{"role": "user", "content": "w20"}, {"role": "assistant", "content": "w21"},
     {"role": "user", "content": "w22 w23"}, {"role": "assistant", "content": "w24 w25"}],
]


def segpack_ids(messages):
  """The ids and mask segpack's default template gives with this tokenizer: per message its
  marker, its words, `<|end|>` (the "\\n" separators are whitespace, no token); trained: the
  assistant's words and `<|end|>`."""
  marker = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
  ids, mask = [], []
  for m in messages:
    words = [int(w[1:]) + 4 for w in m["content"].split()]
    on = int(m["role"] == "assistant")
    ids += [marker[m["role"]], *words, END]
    mask += [0] + [on] * (len(words) + 1)
  return ids, mask


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  """A tokenizer directory with a chat template of its own (`OWN`)."""
  directory = hf_models.make_tokenizer(str(tmp_path_factory.mktemp("model")))
  with open(f"{directory}/chat_template.jinja", "w", encoding="utf-8") as f:
    f.write(OWN)
  return directory


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
  """The same tokenizer without a chat template."""
  return hf_models.make_tokenizer(str(tmp_path_factory.mktemp("plain")))


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
  path = tmp_path_factory.mktemp("in") / "chats.jsonl"
  path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), "utf-8")
  return path


def tokenize(chats, out, tokenizer_dir, *flags):
  return tokenize_cli.main(["--input", str(chats), "--output", str(out), "--tokenizer",
                            f"hf:{tokenizer_dir}", "--no-progress", *flags])


def stored(out):
  src = ShardSource(out)
  src.verify()
  return src, [np.asarray(src[i]).tolist() for i in range(len(src))], [
      np.asarray(src.loss_mask(i)).tolist() for i in range(len(src))]


def test_segpack_renders_with_segpacks_template_though_the_tokenizer_has_its_own(
    model, chats, tmp_path):
  out = tmp_path / "data"
  assert tokenize(chats, out, model, "--format", "chat", "--chat-template", "segpack") == 0
  src, ids, masks = stored(out)
  want = [segpack_ids(m) for m in CONVERSATIONS]
  assert ids == [i for i, _ in want] and masks == [m for _, m in want]
  encoder = chat.ChatEncoder(hf.HfTokenizer(model))
  assert ids == [encoder.encode(m)[0].tolist() for m in CONVERSATIONS]
  described = src.manifest["metadata"]["chat"]
  assert described["renderer"] == "segpack"
  assert described["template"] == dataclasses.asdict(chat.DEFAULT_TEMPLATE)
  assert "add_bos_eos" not in described and "files" not in described
  assert not (out / "chat_template.jinja").exists()
  # Packing adds BOS and EOS around each conversation, as for segpack's template.
  assert not sources.template_writes_special_tokens(src)
  rows = pack_dataset(str(out), seq_len=64, shuffle=False, num_epochs=1)
  row = rows[0]
  segments = [row["input_ids"][row["segment_ids"] == s].tolist()
              for s in np.unique(row["segment_ids"][row["segment_ids"] > 0])]
  assert sorted(segments) == sorted([BOS, *i, EOS] for i, _ in want)
  # The sampler's renderer and export read it as segpack's template.
  assert isinstance(hf_chat.for_dataset(out), chat.ChatEncoder)
  config = packed.get_config("smoke")
  config.data.train = str(out)
  renderer = run_tokenizer.chat_renderer(config, str(tmp_path), stage=False)
  assert hf_export_tokenizer.exported_template(renderer) == chat.DEFAULT_TEMPLATE


@pytest.mark.parametrize("choice", ["auto", "own"])
def test_auto_and_own_render_with_the_tokenizers_own_template(model, chats, tmp_path, choice):
  out = tmp_path / "data"
  assert tokenize(chats, out, model, "--chat-template", choice) == 0  # --format auto: chat
  src, ids, masks = stored(out)
  renderer = hf_chat.HfChatTemplate(model)
  assert ids == [renderer.encode(m)[0].tolist() for m in CONVERSATIONS]
  assert masks == [renderer.encode(m)[1].tolist() for m in CONVERSATIONS]
  assert ids[0][:2] == [BOS, USER]  # the template's BOS: not segpack's rendering
  described = src.manifest["metadata"]["chat"]
  assert described["renderer"] == "hf" and described["add_bos_eos"] is False
  assert sources.template_writes_special_tokens(src)
  assert isinstance(hf_chat.for_dataset(out), hf_chat.HfChatTemplate)


def test_own_without_a_template_is_one_line_naming_the_flag_and_directory(
    plain, chats, tmp_path, capsys):
  assert tokenize(chats, tmp_path / "a", plain, "--chat-template", "own") == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "chat_template='own' (--chat-template)" in err
  assert repr(plain) in err
  assert not (tmp_path / "a" / "manifest.json").exists()
  # A SentencePiece model has none either: refused before one is trained.
  rc = tokenize_cli.main(["--input", str(chats), "--output", str(tmp_path / "b"),
                          "--vocab-size", "40", "--chat-template", "own", "--no-progress"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and "chat_template='own' (--chat-template)" in err
  assert "vocab_size (--vocab-size)" in err
  assert not (tmp_path / "b" / "spm.model").exists()
  # auto and segpack render it with segpack's template.
  assert tokenize(chats, tmp_path / "c", plain, "--chat-template", "segpack") == 0
  assert stored(tmp_path / "c")[1] == [segpack_ids(m)[0] for m in CONVERSATIONS]


def test_another_chat_template_on_resume_is_refused_like_another_option(
    model, chats, tmp_path, capsys):
  out = tmp_path / "data"
  assert tokenize(chats, out, model) == 0
  manifest = (out / "manifest.json").read_bytes()
  assert tokenize(chats, out, model, "--chat-template", "auto") == 0  # the same: kept as is
  assert (out / "manifest.json").read_bytes() == manifest
  capsys.readouterr()
  assert tokenize(chats, out, model, "--train-on", "all") == 2
  other_option = capsys.readouterr().err
  assert "made from other inputs or settings" in other_option
  for choice in ("own", "segpack"):  # own renders the same, but is another choice
    assert tokenize(chats, out, model, "--chat-template", choice) == 2
    assert capsys.readouterr().err == other_option
    assert (out / "manifest.json").read_bytes() == manifest
  assert tokenize(chats, out, model, "--chat-template", "segpack", "--overwrite") == 0
  assert stored(out)[0].manifest["metadata"]["chat"]["renderer"] == "segpack"
  assert tokenize(chats, out, model, "--chat-template", "segpack") == 0


@pytest.mark.parametrize("flags", [["--format", "text"], ["--format", "auto"], []])
def test_a_chat_template_for_plain_text_is_refused(model, tmp_path, capsys, flags):
  text = tmp_path / "docs.jsonl"
  text.write_text(json.dumps({"text": "w1 w2"}) + "\n", "utf-8")
  assert tokenize(text, tmp_path / "out", model, "--chat-template", "segpack", *flags) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1
  assert "chat_template='segpack' (--chat-template) applies to chat data only" in err
  assert "(--format) reads the inputs as plain text" in err
  assert not (tmp_path / "out" / "manifest.json").exists()
  for argv, why in ((["--input", "builtin"], "inputs=['builtin'] (--input) are plain text"),
                    (["--input", "gs://bucket/docs.jsonl"], "a run with a path at a URL")):
    assert tokenize_cli.main([*argv, "--output", str(tmp_path / "b"), "--chat-template", "own",
                              "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "chat_template='own' (--chat-template)" in err and why in err


def test_the_library_argument_is_checked_by_name(chats, tmp_path, capsys):
  with pytest.raises(InputFormatError,
                     match=r"^chat_template \(--chat-template\) must be one of .*'ChatML'$") as e:
    dataset.tokenize_files([chats], tmp_path / "out", vocab_size=40, chat_template="ChatML")
  assert isinstance(e.value, UserError)
  with pytest.raises(SystemExit) as e:
    tokenize_cli.main(["--input", str(chats), "--output", str(tmp_path / "out"),
                       "--chat-template", "ChatML"])
  assert e.value.code == 2 and "--chat-template" in capsys.readouterr().err

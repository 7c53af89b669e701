"""`segpack tokenize --tokenizer hf:PATH` (segpack/text/tokenizers/hf.py,
segpack/text/tokenizers/spec.py).

Every tokenizer here is trained or built by the test itself with the `tokenizers` library; the
oracle is that library's own `Tokenizer.from_file(...).encode(text, add_special_tokens=False)`.
"""

import hashlib
import json
import random
import shutil
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from segpack import pack_dataset  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.data.options import PipelineConfigError, SpecialTokens  # noqa: E402
from segpack.shards import ShardSource  # noqa: E402
from segpack.text import dataset  # noqa: E402
from segpack.text.tokenizers import hf  # noqa: E402
from segpack.text.tokenizers import spec as tokenizer_spec  # noqa: E402
from segpack.text.tokenizers import spm  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold "
         "jackdaws and packing segments into rows keeps every token useful").split()
SPECIALS = ["<unk>", "<pad>", "</s>", "<s>"]  # ids 0..3: eos=2 and bos=3, unlike SentencePiece.
ONE_SHARD = ("--shard-tokens", str(10**9))


def _lines(n, seed):
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) +
          rng.choice(["", ".", "!", " 42", "\n  indented"]) for _ in range(n)]


def _sha(path):
  return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE (at most 400 ids) trained here, whose post-processor adds <s> ... </s>, with a
  tokenizer_config.json naming <s>, </s>, <pad>."""
  root = tmp_path_factory.mktemp("bpe")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_lines(400, seed=0), trainer)
  tok.post_processor = tokenizers.processors.TemplateProcessing(
      single="<s> $A </s>", special_tokens=[("<s>", 3), ("</s>", 2)])
  tok.save(str(root / "tokenizer.json"))
  (root / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
      "pad_token": "<pad>", "unk_token": "<unk>"}))
  return root / "tokenizer.json"


def _docs():
  docs = _lines(60, seed=1)
  docs[7] = "a document that writes </s> and <s> as text"  # Literal special tokens.
  docs[11] = ""  # Empty: not stored.
  return docs


def _jsonl(path, docs):
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
  return path


def _stored(out):
  src = ShardSource(out)
  src.verify()
  return [np.asarray(src[i]).tolist() for i in range(len(src))]


def test_cli_tokens_equal_the_library_encoding_and_manifest_records_the_tokenizer(tmp_path, bpe):
  docs = _docs()
  inp = _jsonl(tmp_path / "in.jsonl", docs)
  rc = tokenize_cli.main(["--input", str(inp), "--output", str(tmp_path / "out"), "--tokenizer",
                          f"hf:{bpe}", "--workers", "1", "--no-progress", *ONE_SHARD])
  assert rc == 0
  ref = tokenizers.Tokenizer.from_file(str(bpe))
  bos, eos, pad = (ref.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
  assert (bos, eos, pad) == (3, 2, 1)
  want = [ref.encode(t, add_special_tokens=False).ids for t in docs if t]
  # The library's default encoding turns "</s>" in the text into the EOS id; segpack keeps it
  # text, so a document never carries an EOS in its middle.
  assert eos in want[7] and bos in want[7]
  ref.encode_special_tokens = True
  want[7] = ref.encode(docs[7], add_special_tokens=False).ids
  got = _stored(tmp_path / "out")
  assert got == want
  assert all(bos not in ids and eos not in ids for ids in got)
  manifest = ShardSource(tmp_path / "out").manifest
  config = bpe.parent / "tokenizer_config.json"
  fingerprint = "sha256:" + hashlib.sha256(f"{_sha(bpe)}\n{_sha(config)}\n".encode()).hexdigest()
  assert manifest["tokenizer_fingerprint"] == fingerprint
  assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == ref.get_vocab_size()
  assert manifest["skipped_empty"] == 1
  meta = manifest["metadata"]["tokenizer"]
  assert meta == {"type": "hf", "model_file": "tokenizer.json",
                  "config_file": "tokenizer_config.json", "fingerprint": fingerprint,
                  "vocab_size": ref.get_vocab_size(), "pad_id": pad, "unk_id": 0,
                  "bos_id": bos, "eos_id": eos}
  assert manifest["metadata"]["tokenizer_file"] == str(bpe)


def test_worker_processes_rebuild_the_tokenizer_from_its_spec(tmp_path, bpe):
  inp = _jsonl(tmp_path / "in.jsonl", _docs())
  for workers, out in ((1, "one"), (2, "two")):
    dataset.tokenize_files([inp], tmp_path / out, tokenizer=f"hf:{bpe}", workers=workers)
  assert _stored(tmp_path / "two") == _stored(tmp_path / "one")
  tok = tokenizer_spec.from_spec(f"hf:{bpe}")
  assert isinstance(tok, tokenizer_spec.Tokenizer) and tok.spec == f"hf:{bpe.resolve()}"
  assert tokenizer_spec.from_spec(tok.spec).fingerprint == tok.fingerprint


def test_pack_dataset_puts_the_tokenizers_bos_and_eos_at_document_boundaries(tmp_path, bpe):
  docs = _docs()
  inp = _jsonl(tmp_path / "in.jsonl", docs)
  dataset.tokenize_files([inp], tmp_path / "out", tokenizer=f"hf:{bpe}", workers=1)
  ref = tokenizers.Tokenizer.from_file(str(bpe))
  ref.encode_special_tokens = True
  want = sorted([3] + ref.encode(t, add_special_tokens=False).ids + [2] for t in docs if t)
  packed = pack_dataset(tmp_path / "out", seq_len=256, shuffle=False, num_epochs=1)
  pieces = []
  for row in packed:
    ids, seg = np.asarray(row["input_ids"]), np.asarray(row["segment_ids"])
    for s in range(1, int(seg.max()) + 1):
      pieces.append(ids[seg == s].tolist())
  assert sorted(pieces) == want


def test_special_ids_without_a_config_come_from_tokenizer_json(tmp_path, bpe):
  plain = tmp_path / "plain"
  plain.mkdir()
  shutil.copy(bpe, plain / "tokenizer.json")
  tok = hf.HfTokenizer(plain / "tokenizer.json")
  # The post-processor's template names BOS and EOS; nothing names a pad token.
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (3, 2, None, 0)
  assert tok.fingerprint == "sha256:" + _sha(bpe)
  # Truncation and padding saved in the file do not cut or pad documents.
  saved = tokenizers.Tokenizer.from_file(str(bpe))
  saved.post_processor = None
  saved.enable_truncation(max_length=3)
  saved.enable_padding(pad_id=1, pad_token="<pad>", length=64)
  bare = tmp_path / "bare"
  bare.mkdir()
  saved.save(str(bare / "tokenizer.json"))
  tok = hf.HfTokenizer(bare / "tokenizer.json")
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, None, 1)
  text = "the quick brown fox jumps over a lazy dog"
  ref = tokenizers.Tokenizer.from_file(str(bpe))
  assert tok.encode(text).tolist() == ref.encode(text, add_special_tokens=False).ids
  assert len(ref.encode(text, add_special_tokens=False).ids) > 3


def test_a_tokenizer_without_bos_makes_pack_dataset_ask_for_one(tmp_path, bpe):
  saved = tokenizers.Tokenizer.from_file(str(bpe))
  saved.post_processor = None
  saved.save(str(tmp_path / "tokenizer.json"))
  inp = _jsonl(tmp_path / "in.jsonl", _docs())
  dataset.tokenize_files([inp], tmp_path / "out", tokenizer=f"hf:{tmp_path / 'tokenizer.json'}",
                         workers=1)
  meta = ShardSource(tmp_path / "out").manifest["metadata"]["tokenizer"]
  assert meta["bos_id"] is None and meta["eos_id"] is None
  with pytest.raises(PipelineConfigError, match="bos_id"):
    pack_dataset(tmp_path / "out", seq_len=64)
  rows = pack_dataset(tmp_path / "out", seq_len=512, shuffle=False, num_epochs=1,
                      special_tokens=SpecialTokens(bos_id=3, eos_id=2))
  first = np.asarray(rows[0]["input_ids"])
  assert first[0] == 3


def test_vocabulary_over_65535_writes_uint32_and_packs(tmp_path):
  vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70_000)}, "<s>": 70_000, "</s>": 70_001}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  rng = np.random.default_rng(0)
  docs = [" ".join(f"w{i}" for i in rng.integers(1, 70_000, size=rng.integers(1, 30)))
          for _ in range(40)]
  docs[0] = "w69999 w65536 w65535 w1"
  inp = _jsonl(tmp_path / "in.jsonl", docs)
  rc = tokenize_cli.main(["--input", str(inp), "--output", str(tmp_path / "out"), "--tokenizer",
                          f"hf:{tmp_path / 'tokenizer.json'}", "--workers", "1", "--no-progress"])
  assert rc == 0
  src = ShardSource(tmp_path / "out")
  assert src.manifest["dtype"] == "uint32" and src.vocab_size == 70_002
  assert (tmp_path / "out" / "shard-00000.tokens").stat().st_size == 4 * src.num_tokens
  want = [[int(w[1:]) for w in d.split()] for d in docs]  # WordLevel: "w<i>" is id i.
  assert _stored(tmp_path / "out") == want
  meta = src.manifest["metadata"]["tokenizer"]
  assert (meta["bos_id"], meta["eos_id"], meta["pad_id"]) == (70_000, 70_001, None)
  rows = pack_dataset(tmp_path / "out", seq_len=64, shuffle=False, num_epochs=1)
  pieces = []
  for row in rows:
    ids, seg = np.asarray(row["input_ids"]), np.asarray(row["segment_ids"])
    pieces += [ids[seg == s].tolist() for s in range(1, int(seg.max()) + 1)]
  assert sorted(pieces) == sorted([70_000] + d + [70_001] for d in want)


def _cli_error(tmp_path, capsys, *flags):
  inp = _jsonl(tmp_path / "in.jsonl", ["some text"])
  rc = tokenize_cli.main(["--input", str(inp), "--output", str(tmp_path / "o"), "--no-progress",
                          *flags])
  assert rc == 2
  return capsys.readouterr().err


def test_errors_name_the_flag_and_the_value(tmp_path, bpe, capsys):
  missing = tmp_path / "nope" / "tokenizer.json"
  err = _cli_error(tmp_path, capsys, "--tokenizer", f"hf:{missing}")
  assert "--tokenizer" in err and str(missing) in err and "does not exist" in err
  (tmp_path / "notes.json").write_text('{"hello": 1}')
  err = _cli_error(tmp_path, capsys, "--tokenizer", f"hf:{tmp_path / 'notes.json'}")
  assert "not a Hugging Face tokenizer.json" in err and "notes.json" in err
  (tmp_path / "text.json").write_text("not json at all")
  err = _cli_error(tmp_path, capsys, "--tokenizer", f"hf:{tmp_path / 'text.json'}")
  assert "not a Hugging Face tokenizer.json" in err
  err = _cli_error(tmp_path, capsys, "--tokenizer", f"bpe:{bpe}")
  assert f"tokenizer='bpe:{bpe}' (--tokenizer)" in err and "hf:PATH" in err
  (tmp_path / "empty_model").mkdir()
  err = _cli_error(tmp_path, capsys, "--tokenizer", f"hf:{tmp_path / 'empty_model'}")
  assert "is a directory without a tokenizer.json" in err and "empty_model" in err
  with pytest.raises(SystemExit):  # argparse: mutually exclusive flags.
    tokenize_cli.main(["--input", "x", "--output", "o", "--tokenizer", f"hf:{bpe}",
                       "--vocab-size", "300"])
  assert "not allowed with" in capsys.readouterr().err
  with pytest.raises(ValueError, match=r"pass one of tokenizer \(--tokenizer\), spm_model "
                     r"\(--spm-model\), .* got tokenizer='hf:.*', spm_model='m.model'$"):
    dataset.tokenize_files(["x"], tmp_path / "o", tokenizer=f"hf:{bpe}", spm_model="m.model")
  with pytest.raises(ValueError, match=r"\(--tokenizer\): inputs=\['builtin'\] \(--input\) "
                     r"take a SentencePiece model only"):
    dataset.tokenize_files(["builtin"], tmp_path / "o", tokenizer=f"hf:{bpe}")


def test_a_model_directory_names_its_tokenizer_json(tmp_path, bpe):
  from_dir = hf.HfTokenizer(bpe.parent)
  from_file = hf.HfTokenizer(bpe)
  assert from_dir.model_file == bpe and from_dir.fingerprint == from_file.fingerprint
  assert from_dir.spec == from_file.spec


def test_config_naming_an_unknown_token_and_missing_library(tmp_path, bpe, monkeypatch):
  shutil.copy(bpe, tmp_path / "tokenizer.json")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin|>"}))
  with pytest.raises(ValueError, match=r"bos_token '<\|begin\|>' is not in the vocabulary"):
    hf.HfTokenizer(tmp_path / "tokenizer.json")
  monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now fails.
  with pytest.raises(ImportError, match=r"segpack\[hf\]"):
    hf.HfTokenizer(bpe)


def test_chat_conversations_with_markers_as_added_tokens(tmp_path, bpe):
  markers = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
  tok = tokenizers.Tokenizer.from_file(str(bpe))
  tok.add_special_tokens(markers)
  tok.save(str(tmp_path / "tokenizer.json"))
  inp = tmp_path / "chat.jsonl"
  inp.write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                          {"role": "assistant", "content": "the fox"}]}) + "\n")
  dataset.tokenize_files([inp], tmp_path / "out", tokenizer=f"hf:{tmp_path / 'tokenizer.json'}",
                         input_format="chat")
  user, assistant, end = (tok.token_to_id(m) for m in markers[1:])
  enc = [tok.encode(t, add_special_tokens=False).ids for t in ("\n", "hi there", "the fox")]
  nl, hi, fox = enc
  want = [user, *nl, *hi, end, *nl, assistant, *nl, *fox, end]
  want_mask = [0] * (len(want) - len(fox) - 1) + [1] * (len(fox) + 1)
  src = ShardSource(tmp_path / "out")
  assert src.has_loss_mask and np.asarray(src[0]).tolist() == want
  assert np.asarray(src.loss_mask(0)).tolist() == want_mask


def test_spm_spec_is_the_same_as_spm_model(tmp_path):
  model = spm.train_spm(_lines(400, seed=2), tmp_path / "m.model", vocab_size=320).model_file
  inp = _jsonl(tmp_path / "in.jsonl", _docs())
  dataset.tokenize_files([inp], tmp_path / "a", spm_model=model, workers=1)
  dataset.tokenize_files([inp], tmp_path / "b", tokenizer=f"spm:{model}", workers=1)
  assert ShardSource(tmp_path / "a").fingerprint == ShardSource(tmp_path / "b").fingerprint
  tok = tokenizer_spec.from_spec(f"spm:{model}")
  assert isinstance(tok, spm.SpmTokenizer) and isinstance(tok, tokenizer_spec.Tokenizer)
  assert tok.spec == f"spm:{model.resolve()}"

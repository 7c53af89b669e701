"""SentencePiece (segpack/text/tokenizers/spm.py): the cache root, the id conventions,
deterministic training, bad model files."""

import hashlib

import numpy as np
import pytest
import sentencepiece

from segpack.text import corpus
from segpack.text.tokenizers import spm
from segpack.text.tokenizers import spm_proto


@pytest.fixture(scope="session")
def small(tmp_path_factory):
  """The small built-in corpus (the same session cache as tests/text/test_corpus.py: built once)."""
  cache = tmp_path_factory.getbasetemp() / "segpack-cache"
  return corpus.ensure_builtin(size="small", cache_dir=cache, workers=1), cache


def test_cache_root_follows_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("SEGPACK_CACHE", str(tmp_path / "c"))
  assert spm.cache_root() == tmp_path / "c"
  monkeypatch.delenv("SEGPACK_CACHE")
  assert str(spm.cache_root()).endswith(".cache/segpack")
  assert spm.cache_root(tmp_path) == tmp_path


def test_tokenizer_conventions_and_exact_round_trip(small):
  built, _ = small
  tok = spm.SpmTokenizer(built.spm_model)
  assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
  assert tok.dtype == np.uint16
  for text in ["def f(x):\n\tif x:\n        return  x  # two spaces\r\n", "  leading\n\n\n",
               "naïve café → ∑ 😀 \x00 \x0c", "", "   ", "\n"]:
    ids = tok.encode(text)
    assert ids.dtype == np.uint16
    assert 1 not in ids.tolist()  # Byte fallback: never <unk>.
    assert tok.decode(ids) == text
  assert tok.decode([2, *tok.encode("ab").tolist(), 3, 0, 0]) == "ab"


def test_training_is_deterministic(tmp_path):
  texts = [t for n, t in corpus.builtin_documents(split="train", size="small")
           if n.startswith("topic:")][:30]
  a = spm.train_spm(texts, tmp_path / "a.model", vocab_size=600)
  b = spm.train_spm(texts, tmp_path / "b.model", vocab_size=600)
  digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()
  assert digest(tmp_path / "a.model") == digest(tmp_path / "b.model")
  assert a.fingerprint == b.fingerprint == "sha256:" + digest(tmp_path / "a.model")
  assert a.vocab_size == 600
  assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_bad_model_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.model"):
    spm.SpmTokenizer(tmp_path / "nope.model")
  (tmp_path / "junk.model").write_bytes(b"not a model")
  with pytest.raises(ValueError, match="junk.model: not a SentencePiece model"):
    spm.SpmTokenizer(tmp_path / "junk.model")
  with pytest.raises(ValueError, match="vocab_size must be an int >= 300.* 10"):
    spm.train_spm(["abc"], tmp_path / "x.model", vocab_size=10)


def test_model_pieces_read_without_protobuf_match_sentencepiece(tmp_path):
  texts = ["def f(x):\n\treturn x  # <|user|> and <|assistant|>\n"] * 50
  tok = spm.train_spm(texts, tmp_path / "m.model", vocab_size=300,
                      user_defined_symbols=["<|user|>", "<|assistant|>"])
  proc = sentencepiece.SentencePieceProcessor(model_file=str(tok.model_file))
  pieces = spm_proto.pieces(tok.model_file.read_bytes())
  assert [p for p, _ in pieces] == [proc.id_to_piece(i) for i in range(proc.get_piece_size())]
  kinds = {i: k for i, (_, k) in enumerate(pieces)}
  assert all((kinds[i] == 3) == proc.is_control(i) for i in kinds)  # CONTROL
  assert all((kinds[i] == 6) == proc.is_byte(i) for i in kinds)  # BYTE
  user = spm_proto.user_defined_pieces(tok.model_file.read_bytes())
  assert {"<|user|>", "<|assistant|>", "\n", "\t"} <= set(user)
  for piece, i in user.items():  # one piece whatever surrounds it
    assert i in proc.encode("x" + piece + "y") and proc.id_to_piece(i) == piece
  assert tok.symbol_id("<|user|>") == user["<|user|>"] and tok.symbol_id("return") is None
  with pytest.raises(spm_proto.ModelFormatError):
    spm_proto.pieces(tok.model_file.read_bytes()[:-7])


def test_a_vocab_smaller_than_the_text_needs_names_the_minimum(tmp_path):
  # 60 distinct characters: 4 reserved + 256 bytes + "\n", "\t" + 60 characters = 322 pieces.
  text = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 60))
  with pytest.raises(ValueError) as e:
    spm.train_spm([text], tmp_path / "m.model", vocab_size=300)
  message = str(e.value)
  assert "vocab_size=300 is smaller than the 322 pieces" in message, message
  assert "at least 322" in message and str(tmp_path / "m.model") in message, message
  assert not (tmp_path / "m.model").exists()
  # The minimum it names is enough.
  assert spm.train_spm([text], tmp_path / "m.model", vocab_size=322).vocab_size >= 322

"""The tokenizer.json `python -m train.export` writes for a run's own SentencePiece model, with
byte fallback (`train.export.tokenizer`): a model trained on lowercase text lacks uppercase
letters, digits, `<`, emoji; `tokenizers` reading the file encodes documents holding them, and
the literal text of byte pieces' names (`<0xFF>`), as SentencePiece does, and export no longer
refuses such a model as "trained with other settings"; the check compares on the run's own
documents, where the same pieces in another order (segmentations of equal score) and the text of
a special token (`<s>`, read as that token by transformers) are warnings and any other
difference a refusal."""

import json
import random

import pytest

tokenizers = pytest.importorskip("tokenizers")

from configs import packed  # noqa: E402
from segpack.text import dataset as dataset_lib  # noqa: E402
from segpack.text.tokenizers import spm  # noqa: E402
from train.export import tokenizer as export_tok  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while code and data train models".split()
CONVERT_SPM = export_tok.convert_spm
ODD = ["Upper", "CASE", "2024", "<0xFF>", "<0x41>", "x<0x3C>", "😀", "👍🏽", "日本", "A<B>C", "0xFF",
       "<0x1F600>", "é"]


def _lowercase(count, seed):
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(count)]


def _mixed(count, seed):
  """Documents of lowercase words with, in most, words the model lacks."""
  rng = random.Random(seed)
  docs = []
  for _ in range(count):
    words = [rng.choice(WORDS + ODD if rng.random() < 0.8 else WORDS)
             for _ in range(rng.randint(1, 25))]
    docs.append(rng.choice([" ", "", "\n"]).join(words))
  return docs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp("spm") / "spm.model"
  tok = spm.train_spm(_lowercase(400, seed=0), path, vocab_size=320)
  pieces = {tok.id_to_piece(i) for i in range(tok.vocab_size)}
  assert not pieces & {"<", "A", "0", "F", "😀"} and "x" in pieces  # what the model lacks
  return str(path)


def _differing(tok, sp, docs):
  return [d for d in docs if tok.encode(d, add_special_tokens=False).ids != sp.encode(d)]


def test_the_exported_tokenizer_encodes_as_sentencepiece_on_byte_fallback_text(model,
                                                                              tmp_path):
  docs = _mixed(100, seed=1)
  assert sum(any(o in d for o in ODD) for d in docs) > 60
  assert any("<0xFF>" in d for d in docs) and any("😀" in d for d in docs)
  out = tmp_path / "tokenizer.json"
  export_tok.spm_tokenizer(model, add_bos=True, texts=docs).save(str(out))
  loaded = tokenizers.Tokenizer.from_file(str(out))
  sp = export_tok._spm_processor(model)  # pylint: disable=protected-access
  assert not _differing(loaded, sp, docs)
  assert any(sp.is_byte(i) for d in docs for i in sp.encode(d))  # byte fallback was used
  assert loaded.encode("<0xFF>").ids == [sp.bos_id()] + sp.encode("<0xFF>")
  assert loaded.decode(sp.encode(docs[0])) == docs[0]


def test_without_byte_fallback_or_isolated_characters_the_encodings_differ(model,
                                                                         monkeypatch):
  docs = _mixed(100, seed=1)
  sp = export_tok._spm_processor(model)  # pylint: disable=protected-access
  plain = export_tok.convert_spm(model, add_bos=False, byte_fallback=False)
  assert len(_differing(plain, sp, docs)) > 50  # <unk> where SentencePiece spells bytes
  monkeypatch.setattr(export_tok, "_isolated_chars", lambda sp: "")  # the converter before
  literal = export_tok.convert_spm(model, add_bos=False)
  assert _differing(literal, sp, ["<0xFF>"]) == ["<0xFF>"]  # read as the byte piece 0xFF
  with pytest.raises(export_tok.ExportError, match=r"encodes '<0x41> literal byte piece'"):
    export_tok.spm_tokenizer(model, add_bos=False)


def test_the_check_compares_the_runs_own_documents(model, tmp_path, monkeypatch):
  docs = _mixed(120, seed=2)
  source = tmp_path / "docs.jsonl"
  source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  dataset_lib.tokenize_files([source], tmp_path / "data", spm_model=model, workers=1)
  config = packed.get_config()
  config.data.train = str(tmp_path / "data")
  texts = export_tok.run_documents(config, spm.SpmTokenizer(model))
  assert texts == [d for d in docs if d][:100]  # the first 100 documents, as written
  seen = []
  real = export_tok.convert_spm

  def spying(*args, **kwargs):
    tok = real(*args, **kwargs)
    encode = tok.encode
    return type("Spy", (), {"encode": lambda self, text, **kw: (seen.append(text),
                                                               encode(text, **kw))[1]})()

  monkeypatch.setattr(export_tok, "convert_spm", spying)
  export_tok.spm_tokenizer(model, add_bos=False, texts=texts)
  assert set(texts) <= set(seen) and set(export_tok.BYTE_FALLBACK_TEXTS) <= set(seen)


def _rewriting(monkeypatch, rewrite):
  """`convert_spm` whose tokenizer's ids of the text "tie me" pass through `rewrite`."""
  real = CONVERT_SPM

  class Rewriting:
    def __init__(self, tok):
      self.tok = tok

    def encode(self, text, **kwargs):
      encoded = self.tok.encode(text, **kwargs)
      ids = rewrite(encoded.ids) if text == "tie me" else encoded.ids
      return type("Encoded", (), {"ids": ids})()

  monkeypatch.setattr(export_tok, "convert_spm", lambda *a, **k: Rewriting(real(*a, **k)))


def test_a_document_in_the_same_pieces_reordered_is_a_warning_and_other_ids_refused(
    model, monkeypatch, caplog):
  sp = export_tok._spm_processor(model)  # pylint: disable=protected-access
  assert len(set(sp.encode("tie me"))) > 1  # reversing it changes it
  _rewriting(monkeypatch, lambda ids: ids[::-1])  # equal-score segmentations, broken otherwise
  with caplog.at_level("WARNING"):
    export_tok.spm_tokenizer(model, add_bos=False, texts=["a doc", "tie me"])
  assert ("1 of the run's 2 documents compared encode differently in tokenizer.json: the same "
          "pieces as SentencePiece's in another order") in caplog.text
  assert "'tie me'" in caplog.text and "special token" not in caplog.text
  _rewriting(monkeypatch, lambda ids: ids[:-1] + [sp.unk_id()])  # another piece: refused
  with pytest.raises(export_tok.ExportError,
                     match=r"encodes 'tie me' as \.\.\.\[\d+\] from token 5, "):
    export_tok.spm_tokenizer(model, add_bos=False, texts=["a doc", "tie me"])


def test_the_text_of_a_special_token_in_a_document_is_a_warning(model, caplog):
  """transformers reads `<s>` in text as the BOS (as for every converted SentencePiece model)
  unless told `split_special_tokens=True`, which gives SentencePiece's ids."""
  text = "see <s> and </s> here"
  sp = export_tok._spm_processor(model)  # pylint: disable=protected-access
  tok = export_tok.convert_spm(model, add_bos=False)
  assert tok.encode(text).ids != sp.encode(text)  # read as the special tokens
  with caplog.at_level("WARNING"):
    export_tok.spm_tokenizer(model, add_bos=False, texts=["a doc", text])
  assert ("1 of the run's 2 documents compared encode differently in tokenizer.json: the text "
          "of a special token") in caplog.text and "split_special_tokens=True" in caplog.text


def test_a_probe_text_differing_only_by_special_token_text_is_refused(model, monkeypatch):
  """The negative control of the warnings: the export's own probes must encode exactly."""
  monkeypatch.setattr(export_tok, "PROBE_TEXTS", export_tok.PROBE_TEXTS + ("see <s> here",))
  with pytest.raises(export_tok.ExportError, match=r"encodes 'see <s> here' as"):
    export_tok.spm_tokenizer(model, add_bos=False)

"""`--beam-options` as the README and docs/ingest.md write it: a value that starts with
`--runner=` is Beam's runner, not segpack's `--runner`; an unknown Beam runner is one line."""

import pytest

pytest.importorskip("apache_beam")

from support import small_corpus  # noqa: E402
from segpack.cli import tokenize as tokenize_cli  # noqa: E402
from segpack.shards import ShardSource  # noqa: E402


def test_join_keeps_every_other_argument():
  argv = ["--input", "x", "--runner", "beam", "--beam-options", "--runner=DirectRunner --a=1",
          "--output", "o"]
  assert tokenize_cli.join_beam_options(argv) == [
      "--input", "x", "--runner", "beam", "--beam-options=--runner=DirectRunner --a=1",
      "--output", "o"]
  assert tokenize_cli.join_beam_options(["--beam-options=--x", "a"]) == ["--beam-options=--x", "a"]


def test_the_documented_spelling_runs_on_beams_runner(tmp_path_factory, tmp_path):
  model = small_corpus.spm_model(tmp_path_factory)
  docs = small_corpus.write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in small_corpus.train_texts()[:40]])
  rc = tokenize_cli.main(["--input", str(docs), "--spm-model", str(model), "--runner", "beam",
                          "--beam-options", "--runner=DirectRunner --direct_num_workers=1",
                          "--output", str(tmp_path / "out"), "--no-progress"])
  assert rc == 0
  assert len(ShardSource(tmp_path / "out")) == 40


def test_an_unknown_beam_runner_is_one_line(tmp_path_factory, tmp_path, capsys):
  model = small_corpus.spm_model(tmp_path_factory)
  docs = small_corpus.write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in small_corpus.train_texts()[:5]])
  rc = tokenize_cli.main(["--input", str(docs), "--spm-model", str(model), "--runner", "beam",
                          "--beam-options=--runner=NoSuchRunner", "--output",
                          str(tmp_path / "out"), "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and "Traceback" not in "\n".join(err)
  assert "runner 'NoSuchRunner' is not one Beam can run here" in err[-1]
  assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_local_commands_of_docs_ingest_as_written(tmp_path_factory, tmp_path):
  """docs/ingest.md's DirectRunner block, from a directory holding `corpus/` and `m.model`: in
  this process, then on four worker processes; both datasets hold the same documents in the
  input order (oracle: each text encoded alone with the model)."""
  import shutil

  import numpy as np
  import sentencepiece

  from support import doc_blocks
  texts = small_corpus.train_texts()[:60]
  (tmp_path / "corpus").mkdir()
  small_corpus.write_jsonl(tmp_path / "corpus" / "a.jsonl", [{"text": t} for t in texts[:30]])
  small_corpus.write_jsonl(tmp_path / "corpus" / "b.jsonl", [{"text": t} for t in texts[30:]])
  shutil.copy(small_corpus.spm_model(tmp_path_factory), tmp_path / "m.model")
  commands = doc_blocks.commands("## Command lines", doc="docs/ingest.md")
  assert len(commands) == 2 and "multi_processing" in commands[1]
  for n, command in enumerate(commands):
    list(doc_blocks.run([command], {"data/mine": f"data/mine{n}"}, train_args=[], cwd=tmp_path))
  encoder = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
  want = [encoder.encode(t) for t in texts]
  for n in range(2):
    got = ShardSource(tmp_path / "data" / f"mine{n}")
    assert [list(np.asarray(got[i])) for i in range(len(got))] == want


@pytest.mark.parametrize("beam_options", ["", "--runner=DirectRunner"])  # the workers' runs:
# test_the_local_commands_of_docs_ingest_as_written
def test_the_local_runner_downloads_nothing_and_leaves_no_temporary_directory(
    tmp_path_factory, tmp_path, monkeypatch, beam_options):
  """Recent Beam releases' DirectRunner (2.77's) first tries its Prism runner, which downloads a
  binary from GitHub; segpack's local runs never reach it, and leave nothing in the temporary
  directory. Negative control: with such a Beam, a plain pipeline on the DirectRunner does."""
  import inspect
  import tempfile

  import apache_beam as beam
  from apache_beam.runners.portability import prism_runner
  reached = []

  def refuse(self, *args, **kwargs):
    reached.append(type(self).__name__)
    raise RuntimeError("Prism is not reachable in this test")

  monkeypatch.setattr(prism_runner.PrismRunner, "run_pipeline", refuse)
  temporary = tmp_path / "tmp"
  temporary.mkdir()
  monkeypatch.setenv("TMPDIR", str(temporary))  # The worker processes' too.
  monkeypatch.setattr(tempfile, "tempdir", str(temporary))
  model = small_corpus.spm_model(tmp_path_factory)
  texts = small_corpus.train_texts()[:20]
  docs = small_corpus.write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
  rc = tokenize_cli.main(["--input", str(docs), "--spm-model", str(model), "--runner", "beam",
                          "--beam-options", beam_options, "--output", str(tmp_path / "out"),
                          "--no-progress"])
  assert rc == 0 and len(ShardSource(tmp_path / "out")) == 20
  assert reached == [] and list(temporary.iterdir()) == []
  from apache_beam.runners.direct import direct_runner
  if "PrismRunner" in inspect.getsource(direct_runner.SwitchingDirectRunner.run_pipeline):
    with beam.Pipeline() as control:
      _ = control | beam.Create([1, 2]) | beam.Map(lambda x: x + 1)
    assert reached == ["PrismRunner"]

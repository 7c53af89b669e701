"""`segpack tokenize --runner beam` with s3:// inputs and outputs, and training on a staged s3://
dataset, against a real S3 API: a moto server on 127.0.0.1 (no other address is contacted).

Oracles: the local path (`--runner local` on local copies of the same files) and each document
encoded alone; for reruns (after a failed unit, or a `segpack tokenize` process killed with
SIGKILL), an uninterrupted run (same files, same bytes); for staging, the bytes in the bucket,
read with boto3; for `metadata_sha256`, the digest computed here from its definition.
"""

import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from segpack.cli import tokenize as tokenize_cli
from segpack.shards import ShardFormatError, ShardSource, staging
from segpack.text import dataset
from segpack.text.beam import pipeline as beam_pipeline
from segpack.text.beam import remote as beam_remote
from segpack.text.beam import remote_inputs
from segpack.text.tokenizers import spec as tokenizer_spec
from segpack.text.tokenizers import spm

from support import doc_blocks
from support import small_corpus
from support import paths

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")
portpicker = pytest.importorskip("portpicker")
pytest.importorskip("apache_beam")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = str(paths.REPO)
BUCKET = "segpack-test"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
  """A moto S3 server on a free loopback port, dummy credentials in the environment, a bucket;
  `$SEGPACK_CACHE` (staged copies, verified files) in a temporary directory."""
  port = portpicker.pick_unused_port()
  logging.getLogger("werkzeug").setLevel(logging.ERROR)  # One line per request otherwise.
  server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
  server.start()
  endpoint = f"http://127.0.0.1:{port}"
  env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint,
         "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
         "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
  with pytest.MonkeyPatch.context() as mp:
    for key, value in env.items():
      mp.setenv(key, value)
    mp.delenv("AWS_PROFILE", raising=False)
    mp.setenv("SEGPACK_CACHE", str(tmp_path_factory.mktemp("segpack-cache")))
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=BUCKET)
    yield types.SimpleNamespace(
        client=client, env=env,
        options=(f"--s3_endpoint_url={endpoint} --s3_access_key_id=testing "
                 f"--s3_secret_access_key=testing --s3_region_name=us-east-1"))
  server.stop()


def _keys(s3, prefix):
  pages = s3.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
  return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def _get(s3, key):
  return s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, s3, model, texts):
  """Three inputs (JSONL with an empty record, Parquet, gzipped JSONL) here and under s3://,
  and the model there too; listed order a.jsonl, c.parquet, sub/b.jsonl.gz."""
  d = tmp_path_factory.mktemp("inputs")
  a = small_corpus.write_jsonl(d / "a.jsonl", [{"text": t} for t in texts[:50]] + [{"text": ""}])
  c = d / "c.parquet"
  pq.write_table(pa.table({"text": texts[50:80]}), c)
  b = small_corpus.write_jsonl(d / "b.jsonl.gz", [{"text": t} for t in texts[80:]], gz=True)
  for key, path in (("in/a.jsonl", a), ("in/c.parquet", c), ("in/sub/b.jsonl.gz", b),
                    ("models/m.model", model)):
    s3.client.put_object(Bucket=BUCKET, Key=key, Body=open(path, "rb").read())
  return [a, c, b]


def _tokenize(args):
  return tokenize_cli.main([*args, "--runner", "beam", "--no-progress"])


def _doc_subs(s3):
  """docs/ingest.md's names of the local S3 API, as this module's server has them."""
  return {"BUCKET": BUCKET, "http://127.0.0.1:PORT": s3.env["AWS_ENDPOINT_URL_S3"],
          "=KEY": "=testing", "=SECRET": "=testing"}


@pytest.fixture(scope="module")
def remote_dataset(s3, inputs):
  """s3://BUCKET/out, tokenized from s3://BUCKET/in/ with the model at s3://BUCKET/models/: the
  command of docs/ingest.md's S3 API block as written, in smaller units and shards."""
  (command,) = doc_blocks.commands("## Command lines", doc="docs/ingest.md", index=2)
  for a, b in _doc_subs(s3).items():
    command = command.replace(a, b)
  argv = shlex.split(command)
  assert argv[:4] == ["python", "-m", "segpack", "tokenize"]
  assert _tokenize([*argv[4:], "--unit-records", "16", "--shard-tokens", "3000"]) == 0
  return f"s3://{BUCKET}/out"


def _documents(src):
  src.verify()
  return [np.array(src[i]) for i in range(len(src))]


def test_s3_input_and_output_equal_the_local_path(tmp_path, s3, inputs, model, texts,
                                                  remote_dataset, monkeypatch):
  monkeypatch.setenv("SEGPACK_CACHE", str(tmp_path / "cache"))
  (local,) = dataset.tokenize_files(inputs, tmp_path / "local", spm_model=model, workers=1)
  got, want = ShardSource(remote_dataset), ShardSource(tmp_path / "local")
  assert got.path.is_relative_to(tmp_path / "cache" / "staged")
  np.testing.assert_array_equal(got.lengths, want.lengths)
  tok = spm.SpmTokenizer(model)
  alone = [tok.encode(t) for t in texts if t]  # Each document encoded alone.
  docs = _documents(got)
  assert len(docs) == len(alone) == local.documents == len(texts)
  assert all(np.array_equal(g, w) for g, w in zip(docs, alone))
  assert all(np.array_equal(g, w) for g, w in zip(docs, _documents(want)))
  for key in ("dtype", "vocab_size", "tokenizer_fingerprint", "num_documents", "num_tokens",
              "skipped_empty", "inputs"):
    assert got.manifest[key] == want.manifest[key], key
  assert got.manifest["skipped_empty"] == 1 and got.manifest["metadata"]["runner"] == "beam"
  assert got.manifest["metadata"]["spm_model"] == f"s3://{BUCKET}/models/m.model"
  assert got.manifest["metadata"]["inputs"] == [f"s3://{BUCKET}/in/a.jsonl",
                                                f"s3://{BUCKET}/in/c.parquet",
                                                f"s3://{BUCKET}/in/sub/b.jsonl.gz"]
  # In the bucket: the manifest and exactly the files it lists, each with its checksum.
  keys = _keys(s3, "out/")
  listed = {f"out/{s[k]}" for s in got.manifest["shards"] for k in ("tokens", "offsets")}
  assert set(keys) == listed | {"out/manifest.json"}
  assert len(got.manifest["shards"]) > 3
  shard = got.manifest["shards"][-1]
  assert hashlib.sha256(_get(s3, f"out/{shard['tokens']}")).hexdigest() == shard["sha256"]["tokens"]


def test_local_runner_refuses_urls_in_one_line(tmp_path, model, capsys):
  code = tokenize_cli.main(["--input", f"s3://{BUCKET}/in", "--output", str(tmp_path / "o"),
                            "--spm-model", str(model), "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1, err
  assert err[0].startswith("segpack tokenize: error: 's3://")
  assert "runner='local' (--runner) reads and writes local paths only" in err[0]
  assert not (tmp_path / "o").exists()


def test_failed_s3_run_reruns_complete_and_identical(s3, remote_dataset, monkeypatch, capsys):
  """A unit fails after two finished: the rerun keeps them and ends as the uninterrupted run
  (`remote_dataset`, same settings) did."""
  out = f"s3://{BUCKET}/killed"
  args = ["--input", f"s3://{BUCKET}/in", "--output", out, "--spm-model",
          f"s3://{BUCKET}/models/m.model", "--unit-records", "16", "--shard-tokens", "3000",
          "--beam-options", s3.options]
  real, units = beam_pipeline._shard_record, set()

  def dies_in_the_third_unit(output, stem, *a):
    units.add(stem.rsplit("-", 1)[0])
    if len(units) == 3:
      raise RuntimeError("worker lost")
    return real(output, stem, *a)

  monkeypatch.setattr(beam_pipeline, "_shard_record", dies_in_the_third_unit)
  with pytest.raises(RuntimeError, match="worker lost"):
    beam_remote.tokenize_remote(
        [f"s3://{BUCKET}/in"], out, runner="beam", spm_model=f"s3://{BUCKET}/models/m.model",
        unit_records=16, shard_tokens=3000, beam_options=s3.options)
  monkeypatch.setattr(beam_pipeline, "_shard_record", real)
  keys = _keys(s3, "killed/")
  assert "killed/manifest.json" not in keys
  done = [k for k in keys if k.endswith(".done.json")]
  assert len(done) == 2
  with pytest.raises(ShardFormatError, match="missing manifest"):
    ShardSource(out)
  # A file of a unit without a done-record (its worker died before the record was written).
  s3.client.put_object(Bucket=BUCKET, Key="killed/shard-00000-00009-00000.tokens", Body=b"half")
  capsys.readouterr()
  assert _tokenize(args) == 0
  keys = _keys(s3, "killed/")
  assert not [k for k in keys if k.endswith(".done.json")]
  assert "killed/shard-00000-00009-00000.tokens" not in keys  # A unit that does not exist.
  table = capsys.readouterr().out
  kept = int(table.split("kept from an earlier run)")[1].split("(")[1].split(")")[0])
  assert kept >= 2, table
  rerun = json.loads(_get(s3, "killed/manifest.json"))
  once = json.loads(_get(s3, "out/manifest.json"))
  assert rerun["shards"] == once["shards"]  # Same files, same checksums.
  assert rerun["num_documents"] == len(small_corpus.train_texts())  # The empty one skipped.
  assert {k.removeprefix("killed/"): v for k, v in keys.items()} == {
      k.removeprefix("out/"): v for k, v in _keys(s3, "out/").items()}
  assert _tokenize(args) == 0  # A finished dataset: a no-op.


@pytest.mark.slow
def test_remote_dataset_trains_after_staging_and_stages_once(tmp_path, s3, remote_dataset):
  """docs/ingest.md's "Training on a remote dataset" block as written."""
  cache = tmp_path / "cache"
  commands = doc_blocks.commands("## Training on a remote dataset", doc="docs/ingest.md")
  assert f"--config.data.train={remote_dataset}" in commands[0].replace("BUCKET", BUCKET)
  for _ in doc_blocks.run(commands, _doc_subs(s3), train_args=[
      "--config.data.eval_share=0.1", f"--workdir={tmp_path / 'run'}"],
                          env={**s3.env, "SEGPACK_CACHE": str(cache)}):
    pass
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert losses and np.all(np.isfinite(losses))
  folder = staging.staged_dir(url=remote_dataset, cache_dir=cache)
  stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
  assert (folder / "manifest.json").read_bytes() == _get(s3, "out/manifest.json")
  again = staging.stage_dataset(url=remote_dataset, cache_dir=cache, progress=False)
  assert again.path == folder and again.downloaded_bytes == 0
  assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
  assert again.total_bytes == sum(v for k, v in _keys(s3, "out/").items()
                                  if not k.endswith("manifest.json"))


def test_staging_resumes_a_partial_copy_and_refuses_a_corrupt_shard(tmp_path, s3, remote_dataset):
  for key in _keys(s3, "out/"):
    s3.client.copy_object(Bucket=BUCKET, Key="copy/" + key[4:],
                          CopySource={"Bucket": BUCKET, "Key": key})
  url = f"s3://{BUCKET}/copy"
  manifest = json.loads(_get(s3, "copy/manifest.json"))
  name = manifest["shards"][1]["tokens"]
  body = _get(s3, f"copy/{name}")
  folder = staging.staged_dir(url=url, cache_dir=tmp_path)
  folder.mkdir(parents=True)
  (folder / f"{name}.part").write_bytes(body[:len(body) // 2])  # An interrupted download.
  first = staging.stage_dataset(url=url, cache_dir=tmp_path, progress=False)
  assert first.downloaded_bytes == first.total_bytes - len(body) // 2
  assert (folder / name).read_bytes() == body and not list(folder.glob("*.part"))
  # A shard changed in the bucket (same size, other bytes): refused by its URL, nothing kept.
  bad = bytes([body[0] ^ 1]) + body[1:]
  s3.client.put_object(Bucket=BUCKET, Key=f"copy/{name}", Body=bad)
  s3.client.put_object(Bucket=BUCKET, Key="copy/manifest.json",
                       Body=_get(s3, "copy/manifest.json") + b"\n")  # A new version.
  with pytest.raises(ShardFormatError, match=f"{url}/{name}: checksum mismatch"):
    staging.stage_dataset(url=url, cache_dir=tmp_path / "fresh", progress=False)
  fresh = staging.staged_dir(url=url, cache_dir=tmp_path / "fresh")
  assert not (fresh / "manifest.json").exists() and not (fresh / name).exists()
  # The earlier copy keeps its intact file; without it, the new version is refused too.
  kept = staging.stage_dataset(url=url, cache_dir=tmp_path, progress=False)
  assert kept.downloaded_bytes == 0 and (folder / "manifest.json").read_bytes().endswith(b"\n\n")
  (folder / name).unlink()
  (folder / "manifest.json").write_bytes(b"{}")  # An older version.
  with pytest.raises(ShardFormatError, match="checksum mismatch"):
    staging.stage_dataset(url=url, cache_dir=tmp_path, progress=False)
  assert not (folder / "manifest.json").exists()  # The copy no longer looks complete.


def test_hf_tokenizer_at_a_url_is_copied_with_its_config(tmp_path, s3, texts):
  tokenizers = pytest.importorskip("tokenizers")
  byte_level = tokenizers.pre_tokenizers.ByteLevel
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = byte_level(add_prefix_space=False)
  tok.train_from_iterator(texts[:20], tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
      initial_alphabet=byte_level.alphabet()))
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>",
                                                              "eos_token": "</s>"}))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    s3.client.put_object(Bucket=BUCKET, Key=f"tok/{name}", Body=(tmp_path / name).read_bytes())
  spec = remote_inputs.local_tokenizer_spec(f"hf:s3://{BUCKET}/tok/tokenizer.json",
                                            cache_dir=tmp_path / "cache")
  assert spec.startswith(f"hf:{tmp_path / 'cache' / 'remote-tokenizers'}")
  got, want = (tokenizer_spec.from_spec(s) for s in (spec, f"hf:{tmp_path / 'tokenizer.json'}"))
  assert got.fingerprint == want.fingerprint  # Both files, so the same special ids too.
  assert (got.bos_id, got.eos_id) == (want.bos_id, want.eos_id) == (1, 2)
  assert np.array_equal(got.encode(texts[0]), want.encode(texts[0]))
  assert remote_inputs.remote_flags(paths=[f"hf:s3://{BUCKET}/t.json", "spm:m.model", None,
                                           "data/x", f"gs://{BUCKET}/x"]) == [
      f"hf:s3://{BUCKET}/t.json", f"gs://{BUCKET}/x"]


def _metadata_digest(metadata):
  """The manifest's `metadata_sha256` as docs/format.md defines it, computed here."""
  text = json.dumps(metadata, sort_keys=True, separators=(",", ":"))
  return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _one_line_error(args, capsys):
  """Runs `segpack tokenize --runner beam ARGS`; (exit code, the stderr lines)."""
  capsys.readouterr()
  code = _tokenize(args)
  return code, capsys.readouterr().err.strip().splitlines()


def test_finished_local_beam_dataset_is_checked_on_rerun_and_rebuilt_with_overwrite(
    tmp_path, model, texts, capsys):
  inp = small_corpus.write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts[:40]])
  out = tmp_path / "out"
  args = ["--input", str(inp), "--output", str(out), "--spm-model", str(model),
          "--unit-records", "8", "--shard-tokens", "3000"]
  assert _tokenize(args) == 0
  manifest = json.loads((out / "manifest.json").read_text())
  assert manifest["metadata_sha256"] == _metadata_digest(manifest["metadata"])
  assert manifest["metadata"]["runner"] == "beam" and len(manifest["shards"]) >= 5
  original = {p.name: p.read_bytes() for p in out.iterdir()}
  stamp = (out / "manifest.json").stat().st_mtime_ns
  assert _tokenize(args) == 0 and (out / "manifest.json").stat().st_mtime_ns == stamp
  first, second = manifest["shards"][0], manifest["shards"][1]
  (out / first["tokens"]).unlink()
  (out / second["offsets"]).write_bytes(original[second["offsets"]][:-8])
  code, err = _one_line_error(args, capsys)
  assert code == 2 and len(err) == 1, err
  assert (f"holds a finished dataset with missing or damaged files: {first['tokens']} (missing), "
          f"{second['offsets']} ({len(original[second['offsets']]) - 8} bytes, expected "
          f"{len(original[second['offsets']])}); pass overwrite=True (--overwrite) to rebuild "
          f"it") in err[0]
  assert not (out / first["tokens"]).exists()  # Refused: nothing changed.
  # Same sizes, other bytes: the checksum names the file.
  (out / first["tokens"]).write_bytes(original[first["tokens"]])
  (out / second["offsets"]).write_bytes(original[second["offsets"]])
  body = original[first["tokens"]]
  (out / first["tokens"]).write_bytes(bytes([body[0] ^ 1]) + body[1:])
  code, err = _one_line_error(args, capsys)
  assert code == 2 and len(err) == 1 and "that is damaged" in err[0], err
  assert first["tokens"] in err[0] and "--overwrite" in err[0]
  # A metadata value edited in place (the BOS id every row would carry).
  (out / first["tokens"]).write_bytes(body)
  edited = json.loads(original["manifest.json"])
  edited["metadata"]["tokenizer"]["bos_id"] += 1
  (out / "manifest.json").write_text(json.dumps(edited))
  code, err = _one_line_error(args, capsys)
  assert code == 2 and len(err) == 1 and "metadata_sha256" in err[0], err
  (out / "manifest.json").write_bytes(b"{not json")
  code, err = _one_line_error(args, capsys)
  assert code == 2 and len(err) == 1 and "the manifest is unreadable" in err[0], err
  # --overwrite rebuilds, byte for byte the first run's dataset (the earlier files removed first).
  (out / first["tokens"]).unlink()
  assert _tokenize([*args, "--overwrite"]) == 0
  assert {p.name: p.read_bytes() for p in out.iterdir()} == original


def test_finished_s3_dataset_is_checked_on_rerun_and_rebuilt_with_overwrite(
    s3, remote_dataset, capsys):
  for key in _keys(s3, "out/"):
    s3.client.copy_object(Bucket=BUCKET, Key="fin/" + key[4:],
                          CopySource={"Bucket": BUCKET, "Key": key})
  url = f"s3://{BUCKET}/fin"
  args = ["--input", f"s3://{BUCKET}/in", "--output", url, "--spm-model",
          f"s3://{BUCKET}/models/m.model", "--unit-records", "16", "--shard-tokens", "3000",
          "--beam-options", s3.options]
  manifest_bytes = _get(s3, "out/manifest.json")
  manifest = json.loads(manifest_bytes)
  assert manifest["metadata_sha256"] == _metadata_digest(manifest["metadata"])
  before = _keys(s3, "fin/")
  assert _tokenize(args) == 0 and _keys(s3, "fin/") == before  # Finished: left alone.
  first, second = manifest["shards"][0], manifest["shards"][1]
  s3.client.delete_object(Bucket=BUCKET, Key=f"fin/{first['tokens']}")
  s3.client.put_object(Bucket=BUCKET, Key=f"fin/{second['offsets']}", Body=b"\0" * 8)
  code, err = _one_line_error(args, capsys)
  assert code == 2 and len(err) == 1, err
  assert (f"output='{url}' (--output) holds a finished dataset with missing or damaged files: "
          f"{first['tokens']} (missing), {second['offsets']} (8 bytes, expected "
          f"{before['fin/' + second['offsets']]}); pass overwrite=True (--overwrite)") in err[0]
  edited = json.loads(manifest_bytes)
  edited["metadata"]["tokenizer"]["eos_id"] += 1
  s3.client.put_object(Bucket=BUCKET, Key="fin/manifest.json", Body=json.dumps(edited).encode())
  code, err = _one_line_error(args, capsys)
  assert code == 2 and len(err) == 1, err
  assert f"{url}/manifest.json: metadata does not match metadata_sha256" in err[0]
  assert "segpack-manifest-" not in err[0]  # The URL, not the local copy it was read from.
  assert _tokenize([*args, "--overwrite"]) == 0
  assert _keys(s3, "fin/") == before and _get(s3, "fin/manifest.json") == manifest_bytes
  assert _get(s3, f"fin/{first['tokens']}") == _get(s3, f"out/{first['tokens']}")


@pytest.mark.slow
def test_sigkilled_s3_run_reruns_complete_and_identical(s3, remote_dataset, capsys, tmp_path):
  """`segpack tokenize` in its own process, killed (SIGKILL) once units are done in the bucket;
  the rerun equals the uninterrupted run (`remote_dataset`, same settings) file for file."""
  out = f"s3://{BUCKET}/sigkilled"
  args = ["--input", f"s3://{BUCKET}/in", "--output", out, "--spm-model",
          f"s3://{BUCKET}/models/m.model", "--unit-records", "16", "--shard-tokens", "3000",
          "--beam-options", s3.options]
  # A killed Beam leaves its pipeline's temporary directory behind: keep it in the test's own.
  env = {**os.environ, **s3.env, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
  proc = subprocess.Popen(
      [sys.executable, "-m", "segpack", "tokenize", *args, "--runner", "beam", "--no-progress"],
      cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      start_new_session=True)
  deadline, done = time.monotonic() + 60, []
  while time.monotonic() < deadline and len(done) < 2 and proc.poll() is None:
    done = [k for k in _keys(s3, "sigkilled/") if k.endswith(".done.json")]
    time.sleep(0.02)
  os.killpg(proc.pid, signal.SIGKILL)  # The runner and any worker it started.
  proc.wait()
  keys = _keys(s3, "sigkilled/")
  assert "sigkilled/manifest.json" not in keys, "finished before it could be killed"
  assert len([k for k in keys if k.endswith(".done.json")]) >= 2
  capsys.readouterr()
  assert _tokenize(args) == 0
  table = capsys.readouterr().out
  kept = int(table.split("kept from an earlier run)")[1].split("(")[1].split(")")[0])
  assert kept >= 2, table
  rerun, once = _keys(s3, "sigkilled/"), _keys(s3, "out/")
  assert {k.removeprefix("sigkilled/"): v for k, v in rerun.items()} == {
      k.removeprefix("out/"): v for k, v in once.items()}
  for key in once:  # Every file, the manifest too, byte for byte.
    assert _get(s3, key) == _get(s3, "sigkilled/" + key.removeprefix("out/")), key


def test_staging_a_url_without_manifest_leaves_nothing_behind(tmp_path, s3, monkeypatch):
  url = f"s3://{BUCKET}/no-dataset"
  s3.client.put_object(Bucket=BUCKET, Key="no-dataset/shard-00000.tokens", Body=b"\0\0")
  with pytest.raises(ShardFormatError) as e:
    staging.stage_dataset(url=url, cache_dir=tmp_path / "cache", progress=False)
  assert str(e.value) == (f"{url}/manifest.json: missing manifest, so {url} is not a finished "
                          f"dataset (rerun `segpack tokenize` to complete it); nothing was staged")
  assert not (tmp_path / "cache").exists()
  # A manifest that is not JSON: refused in the lock; the empty folder goes, the lock stays.
  s3.client.put_object(Bucket=BUCKET, Key="no-dataset/manifest.json", Body=b"{not json")
  with pytest.raises(ShardFormatError, match=f"{url}/manifest.json: corrupt manifest"):
    staging.stage_dataset(url=url, cache_dir=tmp_path / "cache", progress=False)
  assert [p.name for p in (tmp_path / "cache" / "staged").iterdir()] == [
      staging.staged_dir(url=url, cache_dir=tmp_path / "cache").name + ".lock"]


def test_staging_a_url_without_apache_beam_is_one_line(tmp_path, s3, remote_dataset, monkeypatch):
  monkeypatch.setitem(sys.modules, "apache_beam.io.filesystems", None)  # Not installed.
  with pytest.raises(ShardFormatError) as e:
    staging.stage_dataset(url=remote_dataset, cache_dir=tmp_path / "cache", progress=False)
  message = str(e.value)
  assert message.startswith(f"{remote_dataset}: ") and "\n" not in message
  assert message.endswith("pip install 'segpack[beam]'")
  assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_training_on_a_url_without_apache_beam_is_one_line_exit_2(tmp_path, s3, remote_dataset):
  """The trainer in its own process with `apache_beam` unimportable (as when the extra is not
  installed): its user-error path, one line naming the URL and the extra, exit code 2."""
  cache = tmp_path / "cache"
  env = {**os.environ, **s3.env, "SEGPACK_CACHE": str(cache), "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": ROOT}
  without_beam = ("import runpy, sys; sys.modules['apache_beam'] = None; sys.argv[0] = "
                  "'train.main'; runpy.run_module('train.main', run_name='__main__')")
  run = subprocess.run(
      [sys.executable, "-c", without_beam, "--config=configs/packed.py:smoke",
       f"--config.data.train={remote_dataset}", f"--workdir={tmp_path / 'run'}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  lines = run.stderr.strip().splitlines()
  assert run.returncode == 2, run.stderr[-3000:]
  assert "Traceback" not in run.stderr and lines[-1].startswith("python -m train.main: error: "), lines
  assert remote_dataset in lines[-1] and "pip install 'segpack[beam]'" in lines[-1]
  assert not (cache / "staged").exists()

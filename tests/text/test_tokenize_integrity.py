"""The data side is never silent: a locked `--output`, `--overwrite` that rebuilds, a finished
dataset that lost or damaged files, an unreadable manifest, an input replaced behind the resume
key's back, a manifest too large to read, and shards truncated after they were opened."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from segpack import shards
from segpack.cli import main as cli_main
from segpack.data import options
from segpack.data.packed import pack_dataset
from segpack.shards import format as format_lib
from segpack.text import dataset as dataset_lib
from segpack.text.tokenizers import spm
from configs import packed
from train.runs.errors import RunError
from train.runs import tokenizer as run_tokenizer
from support import paths

ROOT = paths.REPO


def _texts(tmp_path: Path, count: int = 3) -> list[Path]:
  paths = []
  for i in range(count):
    p = tmp_path / f"in{i}.txt"
    p.write_text("\n\n".join(f"document {j} of file {i}: some words, and more words {j * i}"
                             for j in range(40)))
    paths.append(p)
  return paths


def _tokenize(inputs, out, model, capsys, *extra) -> tuple[int, list[str]]:
  """Exit status and stderr lines of `segpack tokenize` (one document per blank-line block)."""
  rc = cli_main.main(["tokenize", "--input", *map(str, inputs), "--output", str(out),
                      "--spm-model", str(model), "--doc-separator", "blank-line",
                      "--shard-tokens", "300", "--workers", "1", "--no-progress", *extra])
  return rc, capsys.readouterr().err.strip().splitlines()


def _documents(path) -> list[list[int]]:
  src = shards.ShardSource(path, verify="always")
  return [src[i].tolist() for i in range(len(src))]


def test_a_second_run_on_the_same_output_is_refused_and_a_killed_one_leaves_no_lock(
    tmp_path, model, capsys):
  inputs, out = _texts(tmp_path), tmp_path / "out"
  holder = subprocess.Popen(
      [sys.executable, "-c",
       "import sys; from pathlib import Path; from segpack import files\n"
       f"with files.file_lock(Path({str(out / dataset_lib.LOCK_NAME)!r}), wait=False):\n"
       "  print('locked', flush=True); sys.stdin.read()"],
      cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    rc, err = _tokenize(inputs, out, model, capsys)
    assert rc == 2 and len(err) == 1, err
    assert f"pid {holder.pid}" in err[0] and "host" in err[0] and "started" in err[0], err
    assert "--output" in err[0] and str(out) in err[0], err
    assert not (out / shards.MANIFEST_NAME).exists()
  finally:
    holder.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
    holder.wait()
  assert (out / dataset_lib.LOCK_NAME).exists()
  rc, err = _tokenize(inputs, out, model, capsys)
  assert rc == 0, err
  assert len(_documents(out)) == 120


def test_overwrite_rebuilds_and_a_plain_rerun_names_missing_or_damaged_files(
    tmp_path, model, capsys):
  inputs, out = _texts(tmp_path), tmp_path / "out"
  assert _tokenize(inputs, out, model, capsys)[0] == 0
  intact = _documents(out)
  manifest = format_lib.load_manifest(out)
  names = [s[k] for s in manifest["shards"] for k in ("tokens", "offsets")]
  assert len(manifest["shards"]) >= 3
  # Damage: one file gone, one resized, one with a byte changed in place (same size).
  (out / names[0]).unlink()
  with open(out / names[3], "ab") as f:
    f.write(b"\0\0")
  data = bytearray((out / names[4]).read_bytes())
  data[1] ^= 0xFF
  (out / names[4]).write_bytes(bytes(data))
  rc, err = _tokenize(inputs, out, model, capsys)
  assert rc == 2 and len(err) == 1, err
  assert names[0] in err[0] and "missing" in err[0] and names[3] in err[0], err
  assert "--overwrite" in err[0], err
  rc, err = _tokenize(inputs, out, model, capsys, "--overwrite")
  assert rc == 0, err
  assert _documents(out) == intact
  # Only the in-place change left: the checksum names the file.
  assert _tokenize(inputs, out, model, capsys)[0] == 0
  data = bytearray((out / names[4]).read_bytes())
  data[-1] ^= 0x01
  (out / names[4]).write_bytes(bytes(data))
  rc, err = _tokenize(inputs, out, model, capsys)
  assert rc == 2 and len(err) == 1 and names[4] in err[0] and "--overwrite" in err[0], err
  assert _tokenize(inputs, out, model, capsys, "--overwrite")[0] == 0
  assert _documents(out) == intact


def test_an_unreadable_manifest_is_named_with_its_reason(tmp_path, model, capsys):
  inputs, out = _texts(tmp_path), tmp_path / "out"
  assert _tokenize(inputs, out, model, capsys)[0] == 0
  manifest = out / shards.MANIFEST_NAME
  cases = [(b'{"format": "segpack-sha', "invalid JSON"), (b"\xff\xfe{}", "not UTF-8")]
  for data, reason in cases:
    manifest.write_bytes(data)
    rc, err = _tokenize(inputs, out, model, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "unreadable" in err[0] and str(manifest) in err[0] and reason in err[0], err
    assert "other inputs" not in err[0], err
  assert _tokenize(inputs, out, model, capsys, "--overwrite")[0] == 0


def test_an_input_replaced_by_same_size_same_mtime_text_is_detected(tmp_path, model, capsys):
  inputs, out = _texts(tmp_path), tmp_path / "out"
  assert _tokenize(inputs, out, model, capsys)[0] == 0
  st = inputs[1].stat()
  text = inputs[1].read_bytes()
  inputs[1].write_bytes(text.replace(b"document 3 of", b"document 9 of"))
  os.utime(inputs[1], ns=(st.st_atime_ns, st.st_mtime_ns))
  assert inputs[1].stat().st_size == st.st_size
  assert inputs[1].stat().st_mtime_ns == st.st_mtime_ns
  rc, err = _tokenize(inputs, out, model, capsys)
  assert rc == 2 and len(err) == 1 and "other inputs" in err[0], err


def _tiny_dataset(path: Path) -> None:
  with shards.ShardWriter(path, vocab_size=100, tokenizer_fingerprint="t", shard_tokens=50) as w:
    for i in range(40):
      w.write(np.arange(1, 2 + i % 9))


def test_stats_refuses_a_manifest_it_cannot_bound_without_reading_it(tmp_path, capsys):
  endless, huge = tmp_path / "endless", tmp_path / "huge"
  _tiny_dataset(endless)
  _tiny_dataset(huge)
  (endless / shards.MANIFEST_NAME).unlink()
  (endless / shards.MANIFEST_NAME).symlink_to("/dev/zero")
  with open(huge / shards.MANIFEST_NAME, "r+b") as f:  # sparse: costs no disk
    f.truncate(format_lib.MAX_MANIFEST_BYTES + 1)
  for path in (endless, huge):
    rc = cli_main.main(["stats", "--data", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(path / shards.MANIFEST_NAME) in err[0] and "64 MiB" in err[0], err


def test_a_shard_truncated_after_open_is_named_not_a_broadcast_error(tmp_path):
  path = tmp_path / "ds"
  _tiny_dataset(path)
  src = shards.ShardSource(path)  # checked now: sizes, offsets, checksums
  rows = pack_dataset(src, seq_len=16, shuffle=False,
                      special_tokens=options.SpecialTokens(add_bos=False, add_eos=False))
  name = "shard-00000.tokens"
  os.truncate(path / name, os.path.getsize(path / name) - 2)
  with pytest.raises(shards.ShardFormatError, match=f"{name}.*truncated"):
    for i in range(len(rows)):
      rows[i]
  with pytest.raises(shards.ShardFormatError, match=f"{name}.*truncated"):  # the next open
    shards.ShardSource(path)
  _tiny_dataset(path)
  src = shards.ShardSource(path)
  name = "shard-00001.offsets"
  os.truncate(path / name, os.path.getsize(path / name) - 8)
  with pytest.raises(shards.ShardFormatError, match=f"{name}.*changed size"):
    src[len(src) - 1]


def test_a_changed_value_in_the_manifest_metadata_is_refused(tmp_path):
  path = tmp_path / "ds"
  with shards.ShardWriter(path, vocab_size=100, tokenizer_fingerprint="t",
                          metadata={"tokenizer": {"bos_id": 2, "eos_id": 3}}) as w:
    for n in (5, 9, 3):
      w.write(np.arange(4, 4 + n))
  manifest = path / shards.MANIFEST_NAME
  text = manifest.read_text()
  assert text.count('"bos_id": 2') == 1
  manifest.write_text(text.replace('"bos_id": 2', '"bos_id": 7'))  # one byte, valid JSON
  with pytest.raises(shards.ShardFormatError, match=f"{manifest}: metadata does not match"):
    pack_dataset(shards.ShardSource(path), seq_len=16)


def test_a_damaged_tokenizer_model_beside_a_dataset_is_refused_by_the_sampler(tmp_path):
  texts = [f"def f{i}(x, y{i % 7}):\n    return x * {i} + y{i % 7} - {i * 31 % 97}\n"
           for i in range(500)]
  model_file = tmp_path / "data" / "spm.model"
  tok = spm.train_spm(texts, model_file, vocab_size=320)
  with shards.ShardWriter(tmp_path / "data", vocab_size=320, tokenizer_fingerprint=tok.fingerprint,
                          metadata={"tokenizer": tok.describe()}) as w:
    w.write(np.arange(4, 9))
  config = packed.get_config("smoke")
  with config.unlocked():
    config.data.train = str(tmp_path / "data")
  assert run_tokenizer.tokenizer_for_run(config).fingerprint == tok.fingerprint
  intact = model_file.read_bytes()
  for pos in range(len(intact) // 2, len(intact)):  # the first one-bit change that still loads
    data = bytearray(intact)
    data[pos] ^= 0x01
    model_file.write_bytes(bytes(data))
    try:
      spm.SpmTokenizer(model_file)
      break
    except ValueError:
      continue
  with pytest.raises(RunError, match=f"{model_file} is not the one"):
    run_tokenizer.tokenizer_for_run(config)

"""A run is self-contained: `python -m train.main` records its relative paths absolute, keeps its
dataset's manifest and tokenizer files in `WORKDIR/datasets/`, and `train.sample` and
`train.export` work from another directory after the dataset moved (without the kept copy
they stop in one line naming the dataset); a relative path saved by an older run still resumes
from the directory it was given in."""

import json
import shutil

import pytest

pytest.importorskip("transformers")

from support import hf_models  # noqa: E402
from support import paths  # noqa: E402
from support.train_configs import run_cli  # noqa: E402
from train import checkpoint_compat as ckpt_compat  # noqa: E402
from train import run_guard  # noqa: E402


@pytest.fixture(scope="module")
def moved_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("moved")
  (root / "project").mkdir()
  model = hf_models.make_tokenizer(hf_models.make_model(str(root / "project" / "base"), "llama"))
  hf_models.write_text_jsonl(str(root / "project" / "docs.jsonl"), 40, seed=2)
  run_cli("segpack", "tokenize", "--input", "docs.jsonl", "--tokenizer", "hf:base", "--output",
          "data/text", cwd=root / "project")
  run_cli("train.main", f"--config={paths.REPO / 'configs' / 'packed.py'}",
          "--config.model.init_from=base",
          "--config.data.train=data/text", "--config.train.num_steps=2",
          "--config.train.batch_size=8", "--config.train.eval_every=0",
          "--config.attention.self_check=False", "--config.packing.seq_len=128",
          f"--workdir={root / 'run'}", cwd=root / "project")
  assert model
  return root


def test_paths_are_recorded_absolute_and_the_data_is_kept(moved_run):
  config = json.loads((moved_run / "run" / "run.json").read_text())["config"]
  assert config["data"]["train"] == str(moved_run / "project" / "data" / "text")
  assert config["model"]["init_from"] == str(moved_run / "project" / "base")
  kept = sorted(p.name for p in (moved_run / "run" / "datasets" / "0").iterdir())
  assert "manifest.json" in kept and "tokenizer.json" in kept
  assert not any(name.startswith("shard-") for name in kept)


def test_sample_and_export_after_the_data_moved_from_another_directory(moved_run, tmp_path):
  shutil.move(str(moved_run / "project" / "data"), str(moved_run / "data-moved"))
  try:
    out = run_cli("train.sample", "--workdir", str(moved_run / "run"), "--prompt", "w1 w2",
                  "--max_new_tokens", "4", cwd=tmp_path)
    assert out.stdout.strip()
    run_cli("train.export", "--workdir", str(moved_run / "run"), "--output",
            str(tmp_path / "exported"), cwd=tmp_path)
    assert (tmp_path / "exported" / "tokenizer.json").is_file()
    # Negative control: without the kept copy the moved dataset is named, in one line.
    shutil.move(str(moved_run / "run" / "datasets"), str(moved_run / "datasets-aside"))
    failed = run_cli("train.sample", "--workdir", str(moved_run / "run"), "--prompt", "w1",
                     "--max_new_tokens", "2", cwd=tmp_path, check=False)
    assert failed.returncode == 2 and "data/text" in failed.stderr
    assert failed.stderr.strip().count("\n") == 0, failed.stderr
  finally:
    if (moved_run / "datasets-aside").exists():
      shutil.move(str(moved_run / "datasets-aside"), str(moved_run / "run" / "datasets"))
    shutil.move(str(moved_run / "data-moved"), str(moved_run / "project" / "data"))


def test_a_relative_path_saved_by_an_older_run_compares_from_its_directory(moved_run,
                                                                          monkeypatch):
  monkeypatch.chdir(moved_run / "project")
  saved = {"data": {"train": "data/text"}, "model": {"init_from": "base"}}
  current = {"data": {"train": str(moved_run / "project" / "data" / "text")},
             "model": {"init_from": str(moved_run / "project" / "base")}}
  assert ckpt_compat.config_differences(saved, current) == []
  monkeypatch.chdir(moved_run)  # from elsewhere the same text names another directory
  assert [d.split(":")[0] for d in ckpt_compat.config_differences(saved, current)] == [
      "data.train", "model.init_from"]
  # A keyword is not a path: the initial weights as the reference stay "init".
  assert run_guard.absolute_value("preference.reference", "init") == "init"
  assert run_guard.absolute_value("preference.reference", "ref") == str(moved_run / "ref")

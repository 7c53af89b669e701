"""What `model.init_from` refuses, each with one line naming the file or field and its value
(exit code 2 from `python -m train.main`): never a traceback, never a silently different model."""

import os

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from support import hf_models  # noqa: E402
from configs import packed  # noqa: E402
from support.train_configs import run_cli  # noqa: E402
from train.hf import config as hf_config, init_from as hf_init, weights as hf_weights  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402


def _adopt(model_dir, seq_len=256):
  config = packed.get_config()
  config.model.init_from = str(model_dir)
  config.packing.seq_len = seq_len
  hf_config.adopt(config)
  return config


def _load(config):
  return hf_weights.load_decoder(config, mesh=sharding_lib.make_mesh())


def _edit_config(model_dir, **changes):
  path = os.path.join(model_dir, "config.json")
  config = hf_models.read_json(path)
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  hf_models.write_json(path, config)


@pytest.fixture()
def tiny(tmp_path):
  return hf_models.make_model(str(tmp_path / "m"), "llama", kv_heads=2)


def test_a_directory_without_config_json(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(hf_config.HfModelError, match="has no config.json"):
    _adopt(tmp_path / "empty")
  with pytest.raises(hf_config.HfModelError, match="is not a directory"):
    _adopt(tmp_path / "absent")
  (tmp_path / "run").mkdir()  # a segpack workdir: the line says how to start from it
  (tmp_path / "run" / "run.json").write_text("{}")
  with pytest.raises(hf_config.HfModelError, match=r"is a segpack run .* python -m "
                     r"train.export --workdir .*run --output EXPORTED, then "
                     r"--config.model.init_from=EXPORTED"):
    _adopt(tmp_path / "run")
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "config.json").write_text("{not json")
  with pytest.raises(hf_config.HfModelError, match="config.json: not readable JSON"):
    _adopt(tmp_path / "bad")


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="gemma2"), "model_type='gemma2' is not supported .*soft-capping"),
    (dict(model_type="gpt2"), "model_type='gpt2' is not supported"),
    (dict(model_type="mixtral"), "model_type='mixtral' is not supported .*mixture-of-experts"),
    (dict(num_local_experts=8), "num_local_experts=8: mixture-of-experts"),
    (dict(quantization_config={"quant_method": "gptq", "bits": 4}),
     "quantization_config=.*quantized checkpoints are not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
     "rope_scaling type 'yarn' is not supported"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling type 'dynamic' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu': only the SiLU"),
    (dict(attention_bias=True), "attention_bias=True: biases on the attention"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_size=None), "hidden_size is missing"),
    (dict(torch_dtype="int8", dtype=None), "torch_dtype='int8' is not one of"),
    # Each field type- and range-checked, named with its value (tracebacks before).
    (dict(num_attention_heads=0), "num_attention_heads=0 is not a finite number > 0"),
    (dict(head_dim="abc"), "head_dim='abc' is not an int"),
    (dict(max_position_embeddings="4096"), "max_position_embeddings='4096' is not an int"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "big"}, rope_theta=None),
     "rope_parameters.rope_theta='big' is not a finite number > 1"),
    (dict(rope_theta=float("nan")), "rope_theta=nan is not a finite number > 1"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps=-1e-06 is not a finite number > 0"),
])
def test_unsupported_models_and_features_are_refused_by_field(tiny, changes, match):
  _edit_config(tiny, **changes)
  with pytest.raises(hf_config.HfModelError, match=match):
    _adopt(tiny)


def test_what_transformers_reads_alike_is_accepted(tiny):
  """`hidden_act: "swish"` is SiLU in transformers; Llama ignores a `sliding_window` field."""
  _edit_config(tiny, hidden_act="swish", sliding_window=16)
  config = _adopt(tiny, seq_len=64)
  assert config.model.sliding_window is None
  hf_init.check_adopted(config)


def test_nan_or_infinite_weights_are_refused_at_import_naming_the_tensor(tmp_path):
  from safetensors.numpy import load_file, save_file
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama")
  path = os.path.join(model_dir, "model.safetensors")
  tensors = load_file(path)
  name = "model.layers.0.mlp.down_proj.weight"
  bad = tensors[name].copy()
  bad[3, 5] = np.nan
  save_file(dict(tensors, **{name: bad}), path, metadata={"format": "pt"})
  with pytest.raises(hf_config.HfModelError, match=f"tensor '{name}' holds NaN or infinite"):
    _load(_adopt(model_dir))


def test_a_sliding_window_shorter_than_the_row(tmp_path):
  model_dir = hf_models.make_model(str(tmp_path / "m"), "mistral", sliding_window=128)
  config = _adopt(model_dir, seq_len=256)
  assert config.model.sliding_window == 128
  with pytest.raises(hf_config.HfModelError, match="seq_len=256 is longer than the model's "
                     "sliding window model.sliding_window=128"):
    hf_init.check_adopted(config)
  hf_init.check_adopted(_adopt(model_dir, seq_len=128))  # rows within the window: fine


def test_tensor_problems_name_the_file_and_tensor(tmp_path):
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", max_shard_size="40KB")
  index = hf_models.read_json(os.path.join(model_dir, hf_weights.INDEX_NAME))
  shard = sorted(set(index["weight_map"].values()))[-1]
  os.rename(os.path.join(model_dir, shard), os.path.join(tmp_path, shard))
  with pytest.raises(hf_config.HfModelError, match=f"names '{shard}'.*which does not exist"):
    _load(_adopt(model_dir))
  # Truncated: the file exists but is shorter than its header says.
  data = (tmp_path / shard).read_bytes()
  (tmp_path / "m" / shard).write_bytes(data[:len(data) - 64])
  with pytest.raises(hf_config.HfModelError, match=f"{shard}: not a readable safetensors file"):
    _load(_adopt(model_dir))


def test_missing_extra_and_misshapen_tensors(tmp_path):
  from safetensors.numpy import load_file, save_file
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama")
  path = os.path.join(model_dir, "model.safetensors")
  tensors = load_file(path)
  name = "model.layers.1.mlp.up_proj.weight"
  save_file({k: v for k, v in tensors.items() if k != name}, path, metadata={"format": "pt"})
  with pytest.raises(hf_config.HfModelError, match=f"tensor '{name}' is missing"):
    _load(_adopt(model_dir))
  extra = dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": tensors[name][:, 0] * 0})
  save_file(extra, path, metadata={"format": "pt"})
  with pytest.raises(hf_config.HfModelError, match="o_proj.bias.*has no place"):
    _load(_adopt(model_dir))
  save_file(dict(tensors, **{name: tensors[name][:, :-1]}), path, metadata={"format": "pt"})
  with pytest.raises(hf_config.HfModelError, match=f"'{name}' has shape"):
    _load(_adopt(model_dir))


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, tiny):
  (tmp_path / "empty").mkdir()
  _edit_config(tiny, model_type="gemma2")
  for model_dir, expected in ((tmp_path / "empty", "has no config.json"),
                              (tiny, "model_type='gemma2' is not supported")):
    out = run_cli("train.main", "--config=configs/packed.py:smoke",
                  f"--config.model.init_from={model_dir}", f"--workdir={tmp_path / 'run'}",
                  check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert expected in out.stderr and str(model_dir) in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_resuming_with_another_init_from_is_refused(tmp_path):
  a = hf_models.make_model(str(tmp_path / "a"), "llama")
  hf_models.make_tokenizer(a)
  b = hf_models.make_model(str(tmp_path / "b"), "llama", seed=1)
  hf_models.make_tokenizer(b)
  hf_models.write_text_jsonl(str(tmp_path / "docs.jsonl"), 40)
  run_cli("segpack", "tokenize", "--input", str(tmp_path / "docs.jsonl"), "--tokenizer",
          f"hf:{a}", "--output", str(tmp_path / "data"))
  common = ["train.main", "--config=configs/packed.py", f"--config.data.train={tmp_path / 'data'}",
            "--config.packing.seq_len=256", "--config.train.num_steps=1",
            "--config.train.eval_every=0", "--config.attention.self_check=False",
            f"--workdir={tmp_path / 'run'}"]
  run_cli(*common, f"--config.model.init_from={a}")
  out = run_cli(*common, f"--config.model.init_from={b}", check=False)
  assert out.returncode == 2, out.stderr[-2000:]
  assert "model.init_from" in out.stderr and str(b) in out.stderr and str(a) in out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_without_the_hf_extra_import_and_export_say_which_extra(tmp_path, tiny, monkeypatch):
  import sys as sys_module
  from train.export import files as hf_export
  monkeypatch.setitem(sys_module.modules, "safetensors", None)
  with pytest.raises(hf_config.HfModelError, match=r"pip install 'segpack\[hf\]'"):
    _load(_adopt(tiny))
  with pytest.raises(hf_export.ExportError, match=r"safetensors package: pip install 'segpack\[hf\]'"):
    hf_export.check_extras()


def test_a_fresh_start_replaces_a_stale_copy_of_another_models_files(tmp_path):
  """A start that saved nothing leaves `hf_source`; the next fresh start from another model
  must not keep the first model's files (the export would ship its tokenizer)."""
  first, second = tmp_path / "first", tmp_path / "second"
  for d, marker in ((first, "one"), (second, "two")):
    d.mkdir()
    hf_models.write_json(str(d / "config.json"), {"marker": marker})
  workdir = tmp_path / "run"
  workdir.mkdir()
  hf_init.keep_source_files(str(first), str(workdir))
  target = hf_init.keep_source_files(str(second), str(workdir))
  assert hf_models.read_json(os.path.join(target, "config.json")) == {"marker": "two"}
  assert sorted(os.listdir(workdir)) == [hf_init.SOURCE_DIR]  # nothing left beside it


def test_a_tied_config_with_a_different_stored_head_is_refused(tmp_path):
  """transformers 5 keeps a stored `lm_head.weight` even when config.json says tied; dropping
  it would import another model, so it is refused by name (an equal copy is fine)."""
  from safetensors.numpy import load_file, save_file
  model_dir = hf_models.make_model(str(tmp_path / "m"), "llama", tie=True)
  path = os.path.join(model_dir, "model.safetensors")
  tensors = load_file(path)
  table = tensors["model.embed_tokens.weight"]
  save_file(dict(tensors, **{"lm_head.weight": table.copy()}), path, metadata={"format": "pt"})
  _load(_adopt(model_dir))  # an equal copy: the same model
  save_file(dict(tensors, **{"lm_head.weight": table * 2}), path, metadata={"format": "pt"})
  with pytest.raises(hf_config.HfModelError, match=r"stored lm_head.weight differs from "
                     r"model.embed_tokens.weight.*tie_word_embeddings to false"):
    _load(_adopt(model_dir))

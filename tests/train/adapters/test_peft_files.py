"""train.adapters.peft_files: PEFT LoRA adapter directories, with peft itself as the oracle.

A tiny `LlamaForCausalLM` (E=32, F=64, 2 layers, 4 heads, 2 kv heads) is built here, nothing is
downloaded. peft writes adapters that `read_adapter` reads back exactly (weights transposed, the
scale of peft's own layers); `write_adapter`'s directory loads into `PeftModel.from_pretrained`
with no missing or unexpected key and gives the logits of the base merged by hand in NumPy.
"""

import copy
import json
import os
import warnings

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy as safetensors_numpy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from segpack.errors import UserError  # noqa: E402
from train.adapters import peft_files  # noqa: E402

LAYERS = 2
# in and out features of each projection of the tiny model (E=32, H*D=32, K*D=16, F=64)
DIMS = {"q": (32, 32), "k": (32, 16), "v": (32, 16), "o": (32, 32), "gate": (32, 64),
        "up": (32, 64), "down": (64, 32)}


@pytest.fixture(scope="module")
def base():
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=LAYERS, num_attention_heads=4,
                                    num_key_value_heads=2)
  return transformers.LlamaForCausalLM(config).eval()


def _module(model, layer, target):
  """The torch module of a projection (`self_attn.q_proj`) in a causal LM or a PeftModel."""
  inner = model.get_base_model() if isinstance(model, peft.PeftModel) else model
  module = inner.model.layers[layer]
  for part in peft_files.TARGETS[target].split("."):
    module = getattr(module, part)
  return module


def _random_tensors(targets, rank, seed=0):
  rng = np.random.default_rng(seed)
  return {(layer, t): (rng.standard_normal((DIMS[t][0], rank)).astype(np.float32) * 0.3,
                       rng.standard_normal((rank, DIMS[t][1])).astype(np.float32) * 0.3)
          for layer in range(LAYERS) for t in targets}


@pytest.mark.parametrize("use_rslora", [False, True])
def test_read_adapter_reads_what_peft_saves(base, tmp_path, use_rslora):
  model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
      r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
      init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.1))
  model.save_pretrained(tmp_path)
  spec, tensors = peft_files.read_adapter(directory=str(tmp_path), num_layers=LAYERS)
  assert (spec.rank, spec.alpha, spec.targets) == (4, 8.0, ("q", "v", "down"))
  assert (spec.use_rslora, spec.dropout) == (use_rslora, 0.1)
  assert sorted(tensors) == [(layer, t) for layer in range(LAYERS) for t in ("down", "q", "v")]
  for (layer, target), (a_IxR, b_RxO) in tensors.items():
    module = _module(model, layer, target)
    assert spec.scale == pytest.approx(module.scaling["default"], rel=1e-12)
    assert a_IxR.dtype == np.float32 and b_RxO.dtype == np.float32
    np.testing.assert_array_equal(a_IxR, module.lora_A["default"].weight.detach().numpy().T)
    np.testing.assert_array_equal(b_RxO, module.lora_B["default"].weight.detach().numpy().T)
    assert np.any(b_RxO != 0)


def _merged(base, spec, tensors):
  """The base model with every adapter merged by hand: `W + scale * (a @ b).T` (torch [out, in])."""
  merged = copy.deepcopy(base)
  with torch.no_grad():
    for (layer, target), (a_IxR, b_RxO) in tensors.items():
      weight = _module(merged, layer, target).weight
      delta_OxI = (spec.scale * (a_IxR.astype(np.float64) @ b_RxO.astype(np.float64))).T
      weight.copy_(torch.from_numpy((weight.numpy().astype(np.float64) + delta_OxI)
                                    .astype(np.float32)))
  return merged


def test_write_adapter_loads_into_peft_with_every_key_and_the_merged_logits(base, tmp_path):
  spec = peft_files.AdapterSpec(rank=3, alpha=5.0, targets=("down", "q", "k", "o"),
                                base_model="tiny-llama")
  assert spec.targets == ("q", "k", "o", "down")
  tensors = _random_tensors(spec.targets, rank=3)
  paths = peft_files.write_adapter(directory=str(tmp_path), spec=spec, tensors=tensors)
  assert [os.path.basename(p) for p in paths] == [peft_files.CONFIG_NAME, peft_files.WEIGHTS_NAME]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
  assert not [w for w in caught if "keys" in str(w.message).lower()], [str(w.message) for w in caught]
  result = model.load_adapter(str(tmp_path), adapter_name="again")
  assert not result.missing_keys and not result.unexpected_keys, result
  assert isinstance(model, peft.PeftModelForCausalLM)
  config = model.peft_config["default"]
  assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (
      3, 5, ["down_proj", "k_proj", "o_proj", "q_proj"])
  assert config.base_model_name_or_path == "tiny-llama"
  for (layer, target), (a_IxR, b_RxO) in tensors.items():
    module = _module(model, layer, target)
    assert module.scaling["default"] == spec.scale
    np.testing.assert_array_equal(module.lora_A["default"].weight.detach().numpy(), a_IxR.T)
    np.testing.assert_array_equal(module.lora_B["default"].weight.detach().numpy(), b_RxO.T)
  input_ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 40]])
  with torch.no_grad():
    got = model(input_ids=input_ids).logits.numpy()
    expected = _merged(base, spec, tensors)(input_ids=input_ids).logits.numpy()
    plain = base(input_ids=input_ids).logits.numpy()
  assert np.abs(expected - plain).max() > 1e-2  # the adapters change the logits
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_then_read_round_trips_and_files_follow_the_umask(tmp_path, dtype):
  spec = peft_files.AdapterSpec(rank=2, alpha=16, targets=("gate", "up"), dropout=0.05,
                                use_rslora=True)
  tensors = _random_tensors(spec.targets, rank=2, seed=1)
  old = os.umask(0o022)
  try:
    peft_files.write_adapter(directory=str(tmp_path), spec=spec, tensors=tensors, dtype=dtype)
  finally:
    os.umask(old)
  for name in (peft_files.CONFIG_NAME, peft_files.WEIGHTS_NAME):
    assert os.stat(tmp_path / name).st_mode & 0o777 == 0o644
  with safetensors.safe_open(str(tmp_path / peft_files.WEIGHTS_NAME), framework="np") as f:
    assert f.metadata() == {"format": "pt"}
  got_spec, got = peft_files.read_adapter(directory=str(tmp_path), num_layers=LAYERS)
  assert got_spec == spec
  cast = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
  for key, (a_IxR, b_RxO) in tensors.items():
    np.testing.assert_array_equal(got[key][0], a_IxR.astype(cast).astype(np.float32))
    np.testing.assert_array_equal(got[key][1], b_RxO.astype(cast).astype(np.float32))


def _write(tmp_path, *, config=None, weights=None):
  """A valid adapter (q and v, rank 2), then its config updated by `config` (None values
  removed) and its weights changed by `weights(dict)`; returns the directory."""
  spec = peft_files.AdapterSpec(rank=2, alpha=4, targets=("q", "v"))
  peft_files.write_adapter(directory=str(tmp_path), spec=spec,
                           tensors=_random_tensors(spec.targets, rank=2))
  path = tmp_path / peft_files.CONFIG_NAME
  cfg = json.loads(path.read_text())
  cfg.update(config or {})
  path.write_text(json.dumps(cfg))
  if weights is not None:
    path = tmp_path / peft_files.WEIGHTS_NAME
    with safetensors.safe_open(str(path), framework="np") as f:
      tensors = {k: f.get_tensor(k) for k in f.keys()}
    weights(tensors)
    path.write_bytes(safetensors_numpy.save(tensors, metadata={"format": "pt"}))
  return tmp_path


def test_lenient_forms_peft_writes_are_read(tmp_path):
  """Keys with the adapter name, target_modules as "all-linear" or a regex of some layers."""
  def renamed(tensors):
    for key in list(tensors):
      tensors[key.replace(".weight", ".default.weight")] = tensors.pop(key)
  directory = _write(tmp_path, config={"target_modules": r".*\.(q_proj|v_proj)"}, weights=renamed)
  spec, tensors = peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)
  assert spec.targets == ("q", "v") and len(tensors) == 4
  def only_layer_1(tensors):
    for key in [k for k in tensors if ".layers.0." in k]:
      del tensors[key]
  directory = _write(tmp_path, config={"target_modules": r"model\.layers\.1\..*_proj"},
                     weights=only_layer_1)
  with pytest.raises(peft_files.AdapterError, match="k_proj"):  # the regex names k too
    peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)
  directory = _write(tmp_path, config={"target_modules": r"model\.layers\.1\.self_attn\.[qv]_proj"},
                     weights=only_layer_1)
  spec, tensors = peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)
  assert spec.targets == ("q", "v") and sorted(tensors) == [(1, "q"), (1, "v")]
  directory = _write(tmp_path, config={"target_modules": "all-linear"})
  with pytest.raises(peft_files.AdapterError, match=r"no base_model\.model\.model\.layers\.0\."
                     r"self_attn\.k_proj\.lora_A\.weight"):
    peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)


def _drop(key):
  return lambda tensors: tensors.pop(key)


def _put(key, value):
  return lambda tensors: tensors.__setitem__(key, value)


def _nan(key):
  def change(tensors):
    tensors[key] = tensors[key].copy()
    tensors[key][0, 0] = np.nan
  return change


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
REFUSALS = {
    "peft_type": ({"peft_type": "PREFIX_TUNING"}, None, "adapter_config.json", "peft_type"),
    "use_dora": ({"use_dora": True}, None, "adapter_config.json", "use_dora=True"),
    "bias": ({"bias": "all"}, None, "adapter_config.json", "bias='all'"),
    "negative_alpha": ({"lora_alpha": -16}, None, "adapter_config.json", "lora_alpha=-16 must be "
                       "> 0"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, None, "adapter_config.json",
                     "rank_pattern={'q_proj': 8}"),
    "alpha_pattern": ({"alpha_pattern": {"v_proj": 2}}, None, "adapter_config.json",
                      "alpha_pattern"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, "adapter_config.json",
                        "modules_to_save=['lm_head']"),
    "layers_to_transform": ({"layers_to_transform": [0]}, None, "adapter_config.json",
                            "layers_to_transform=[0]"),
    "target_lm_head": ({"target_modules": ["q_proj", "v_proj", "lm_head"]}, None,
                       "adapter_config.json", "'lm_head'"),
    "target_regex_embed": ({"target_modules": r".*(q_proj|v_proj|embed_tokens)"}, None,
                           "adapter_config.json", "model.embed_tokens"),
    "weight_lm_head": (None, _put("base_model.model.lm_head.lora_A.weight",
                                  np.zeros((2, 32), np.float32)),
                       "adapter_model.safetensors", "base_model.model.lm_head.lora_A.weight"),
    "layer_out_of_range": (None, _put("base_model.model.model.layers.2.self_attn.q_proj"
                                      ".lora_A.weight", np.zeros((2, 32), np.float32)),
                           "adapter_model.safetensors", "layers.2.self_attn.q_proj"),
    "missing_partner": (None, _drop(f"{Q0}.lora_B.weight"), "adapter_model.safetensors",
                        f"{Q0}.lora_B.weight"),
    "rank_mismatch": (None, _put(f"{Q0}.lora_A.weight", np.zeros((3, 32), np.float32)),
                      "adapter_model.safetensors", f"{Q0}.lora_A.weight"),
    "not_finite": (None, _nan(f"{Q0}.lora_B.weight"), "adapter_model.safetensors",
                   f"{Q0}.lora_B.weight"),
    "int_dtype": (None, _put(f"{Q0}.lora_A.weight", np.zeros((2, 32), np.int32)),
                  "adapter_model.safetensors", "I32"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_file_the_key_and_the_value(tmp_path, case):
  config, weights, file_name, named = REFUSALS[case]
  directory = _write(tmp_path, config=config, weights=weights)
  with pytest.raises(peft_files.AdapterError) as info:
    peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)
  message = str(info.value)
  assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
  assert "\n" not in message
  assert str(directory / file_name) in message and named in message, message


@pytest.mark.parametrize("name", [peft_files.CONFIG_NAME, peft_files.WEIGHTS_NAME])
def test_a_missing_file_is_refused_by_name(tmp_path, name):
  directory = _write(tmp_path)
  (directory / name).unlink()
  with pytest.raises(peft_files.AdapterError, match=f"{directory / name}: no such file"):
    peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)


def test_without_safetensors_an_adapter_is_refused_in_one_line_naming_it_and_its_extra(
    tmp_path, monkeypatch):
  """The package is imported where adapter files are read or written, so a base install (no
  `[hf]` extra) trains without it; reading or writing an adapter then names the package and the
  extra, and a refused write leaves no file."""
  import builtins  # pylint: disable=g-import-not-at-top
  (tmp_path / "read").mkdir()
  directory = _write(tmp_path / "read")
  real_import = builtins.__import__

  def no_safetensors(name, *args, **kwargs):
    if name == "safetensors" or name.startswith("safetensors."):
      raise ImportError(f"No module named {name!r}", name=name)
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, "__import__", no_safetensors)
  want = r"needs the `safetensors` package, which is not installed: pip install 'segpack\[hf\]'$"
  with pytest.raises(peft_files.AdapterError, match=want):
    peft_files.read_adapter(directory=str(directory), num_layers=LAYERS)
  spec = peft_files.AdapterSpec(rank=2, alpha=4, targets=("q",))
  (tmp_path / "write").mkdir()
  with pytest.raises(peft_files.AdapterError, match=want):
    peft_files.write_adapter(directory=str(tmp_path / "write"), spec=spec,
                             tensors=_random_tensors(spec.targets, rank=2))
  assert not list((tmp_path / "write").iterdir())

"""LoRA runs against third-party oracles: the exported PEFT adapter loaded by `peft` and the
merged export loaded by transformers give segpack's logits on packed rows (per document); an
adapter made by `peft` itself continues in segpack with transformers' logits; the base stays
bit-identical; a resume equals an uninterrupted run; another base is refused (a tiny model and
tokenizer made here with transformers; nothing is downloaded)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("transformers")
pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from support import hf_models  # noqa: E402
from support.train_configs import lora_config, run_cli, train_on_processes  # noqa: E402
from train.model import lora as lora_lib  # noqa: E402
from train.export import command as hf_export  # noqa: E402
from train.hf import weights as hf_weights  # noqa: E402
from train.runs import loaded as loaded_run  # noqa: E402
from train.runs.errors import RunError  # noqa: E402
from train import sharding as sharding_lib  # noqa: E402
from train import train as train_lib  # noqa: E402

LENGTHS = (37, 90, 5, 61)  # one packed row of 4 documents, 193 of 256 slots


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("hf") / "base")
  hf_models.make_model(d, "llama", kv_heads=2)
  return hf_models.make_tokenizer(d)


@pytest.fixture(scope="module")
def data_dir(base_dir, tmp_path_factory):
  root = tmp_path_factory.mktemp("text")
  hf_models.write_text_jsonl(str(root / "docs.jsonl"), 60, seed=4)
  run_cli("segpack", "tokenize", "--input", str(root / "docs.jsonl"), "--tokenizer",
          f"hf:{base_dir}", "--output", str(root / "data"))
  return str(root / "data")


@pytest.fixture(scope="module")
def lora_run(base_dir, data_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("runs") / "lora")
  train_lib.train_and_evaluate(lora_config(base_dir, data_dir, steps=3), workdir)
  return workdir


def packed_row():
  """One row of the documents of `LENGTHS` and each document alone."""
  docs = hf_models.documents(len(LENGTHS), lengths=list(LENGTHS), seed=7)
  ids, seg, pos = (np.zeros((1, 256), np.int32) for _ in range(3))
  start = 0
  for i, doc in enumerate(docs):
    ids[0, start:start + len(doc)] = doc
    seg[0, start:start + len(doc)] = i + 1
    pos[0, start:start + len(doc)] = np.arange(len(doc))
    start += len(doc)
  return docs, ids, seg, pos


def segpack_logits(model):
  """segpack's logits of every document of the packed row, cut out per document."""
  docs, ids, seg, pos = packed_row()
  logits = np.asarray(model(ids, segment_ids=seg, segment_positions=pos))[0]
  out, start = [], 0
  for doc in docs:
    out.append(logits[start:start + len(doc)])
    start += len(doc)
  return docs, out


def torch_logits(model, docs):
  import torch
  with torch.no_grad():
    return [model(input_ids=torch.as_tensor(d[None], dtype=torch.long)).logits[0].float().numpy()
            for d in docs]


def load_base(base_dir):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def test_peft_loads_the_exported_adapter_with_segpacks_logits(lora_run, base_dir, tmp_path):
  config, model, _ = loaded_run.load_run(lora_run)
  flat = {}
  jax.tree_util.tree_map_with_path(lambda p, x: flat.__setitem__(jax.tree_util.keystr(p), x),
                                   lora_lib.split(model, adapters=True)[1])
  assert len(flat) == 2 * 7 * 2  # 2 layers x 7 projections x (A, B)
  assert min(float(np.abs(np.asarray(x)).max()) for k, x in flat.items() if "lora_b" in k) > 1e-3
  docs, ours = segpack_logits(model)
  out = tmp_path / "adapter"
  result = hf_export.export(workdir=lora_run, output=str(out), adapter=True)
  assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
  assert result.num_tensors == 28
  spec = json.loads((out / "adapter_config.json").read_text())
  assert spec["r"] == 4 and spec["lora_alpha"] == 8.0
  assert spec["base_model_name_or_path"] == os.path.abspath(base_dir)
  theirs = torch_logits(peft.PeftModel.from_pretrained(load_base(base_dir), str(out)).eval(),
                        docs)
  plain = torch_logits(load_base(base_dir), docs)
  for a, b, c in zip(ours, theirs, plain):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert np.abs(b - c).max() > 1e-2  # negative control: the adapters change the logits


def test_merged_export_loads_in_transformers_with_segpacks_logits(lora_run, tmp_path):
  _, model, _ = loaded_run.load_run(lora_run)
  docs, ours = segpack_logits(model)
  out = tmp_path / "merged"
  hf_export.export(workdir=lora_run, output=str(out))
  assert not (out / "adapter_config.json").exists()
  theirs = torch_logits(load_base(str(out)), docs)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_an_adapter_made_by_peft_continues_with_transformers_logits(base_dir, data_dir,
                                                                      tmp_path):
  made = tmp_path / "peft_adapter"
  lora = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"],
                         init_lora_weights=False)  # random A and B: B is not zero
  peft_model = peft.get_peft_model(load_base(base_dir), lora)
  peft_model.save_pretrained(str(made))
  config = lora_config(base_dir, data_dir, steps=1, rank=2, targets="q,v,down", lr=0.0)
  config.model.lora.alpha = 5.0
  config.model.init_adapter = str(made)
  train_lib.train_and_evaluate(config, str(tmp_path / "run"))  # lr 0: the adapter unchanged
  _, model, _ = loaded_run.load_run(str(tmp_path / "run"))
  docs, ours = segpack_logits(model)
  theirs = torch_logits(peft_model.eval(), docs)
  plain = torch_logits(load_base(base_dir), docs)
  for a, b, c in zip(ours, theirs, plain):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    assert np.abs(b - c).max() > 1e-2  # negative control: the imported adapter is not zero


def _flat(state):
  return {sharding_lib.param_name(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(state)}


def test_the_base_is_bit_identical_after_training(lora_run, base_dir, data_dir, tmp_path):
  _, model, _ = loaded_run.load_run(lora_run)
  after = _flat(lora_lib.split(model, adapters=True)[2])
  config = lora_config(base_dir, data_dir, steps=1, rank=0)
  mesh = sharding_lib.make_mesh(data=1, devices=jax.devices()[:1])
  before = _flat(nnx.split(hf_weights.load_decoder(config, mesh=mesh))[1])  # the import alone
  assert set(after) == set(before) and len(after) == 21
  for path, x in after.items():
    assert np.array_equal(x, before[path]), path
  # Negative control: one step with every weight trainable changes the base.
  train_lib.train_and_evaluate(config, str(tmp_path / "full"))
  _, trained, _ = loaded_run.load_run(str(tmp_path / "full"))
  moved = [p for p, x in _flat(nnx.split(trained)[1]).items()
           if not np.array_equal(x, before[p])]
  assert len(moved) > len(before) // 2


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


@pytest.mark.slow
def test_resume_on_another_process_count_equals_an_uninterrupted_run_and_another_base_is_refused(
    base_dir, data_dir, tmp_path):
  """2 steps on two processes (jax.distributed, 4 CPU devices each), resumed for 2 more in this
  process (8 devices): the losses of one uninterrupted run here, and its adapters."""
  whole, split = str(tmp_path / "whole"), str(tmp_path / "split")

  def config(steps, base=base_dir):
    return lora_config(base, data_dir, steps=steps, constant_rate=True)

  train_lib.train_and_evaluate(config(4), whole)
  train_on_processes(split, f"lora_config({base_dir!r}, {data_dir!r}, steps=2, "
                            f"constant_rate=True)", count=2)
  summary = train_lib.train_and_evaluate(config(4), split)
  assert summary["resumed_from"] == 2
  assert _losses(split) == pytest.approx(_losses(whole), rel=1e-5, abs=1e-5)
  adapters = [jax.tree_util.tree_leaves(lora_lib.split(loaded_run.load_run(w)[1], adapters=True)[1])
              for w in (split, whole)]
  assert len(adapters[0]) == 2 * 7 * 2
  for got, want in zip(*adapters):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)
  other = str(tmp_path / "other")
  shutil.copytree(base_dir, other)
  hf_models.make_model(other, "llama", kv_heads=2, seed=5)  # another base's weights, same shape
  config_ = config(6, base=other)
  with pytest.raises(Exception, match=r"cannot resume from .*/4: its adapters were trained on "
                                      r"the base base-\w+, and model.init_from=") as e:
    config_.model.init_from = base_dir  # the saved path: the config keys agree
    shutil.rmtree(base_dir + "-moved", ignore_errors=True)
    os.rename(base_dir, base_dir + "-moved")
    os.rename(other, base_dir)
    try:
      train_lib.train_and_evaluate(config_, split)
    finally:
      os.rename(base_dir, other)
      os.rename(base_dir + "-moved", base_dir)
  assert "\n" not in str(e.value)
  os.rename(base_dir, base_dir + "-moved")  # sampling and scoring the run: refused as well
  os.rename(other, base_dir)
  try:
    with pytest.raises(RunError, match=r"/4: the run's adapters were trained on the base "
                                       r"base-\w+, and model.init_from=.* now holds base-\w+"):
      loaded_run.load_run(split)
  finally:
    os.rename(base_dir, other)
    os.rename(base_dir + "-moved", base_dir)

"""Adapters wherever the trainer runs: on data x fsdp x tensor and context-parallel meshes of 8
CPU devices a QLoRA (nf4) step gives the losses and gradient norms of a data-parallel run (the dequantized kernels
and the adapters' matmuls laid out as the base's); minibatch packing and mixtures train adapters
and nothing else (tiny models made here; nothing is downloaded)."""

import json

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from support import hf_models  # noqa: E402
from support.train_configs import lora_config, run_cli  # noqa: E402
from train import train as train_lib  # noqa: E402
from train import setup as setup_lib  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("modes")
  base = hf_models.make_tokenizer(hf_models.make_model(str(root / "base"), "llama",
                                                       intermediate_size=128))
  for name, seed in (("a", 4), ("b", 9)):
    hf_models.write_text_jsonl(str(root / f"{name}.jsonl"), 40, seed=seed)
    run_cli("segpack", "tokenize", "--input", str(root / f"{name}.jsonl"), "--tokenizer",
            f"hf:{base}", "--output", str(root / name))
  return root, base


def _config(base, data, **keys):
  """LoRA of rank 4 (alpha 16: the config's own) for 2 steps; `keys` as `group__name=value`."""
  config = lora_config(base, data, steps=2, lr=1e-2, alpha=16.0)
  for key, value in keys.items():
    group, *rest = key.split("__")
    node = config[group]
    for name in rest[:-1]:
      node = node[name]
    node[rest[-1]] = value
  return config


def _train(config, workdir):
  train_lib.train_and_evaluate(config, str(workdir))
  with open(workdir / "metrics.jsonl") as f:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, f) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def data_parallel(dirs, tmp_path_factory):
  """The QLoRA run on a data-parallel mesh of 8 devices: the losses and gradient norms."""
  root, base = dirs
  return _train(_config(base, str(root / "a"), model__lora__base_dtype="nf4"),
                tmp_path_factory.mktemp("dp") / "run")


@pytest.mark.parametrize("mesh", [dict(data=2, fsdp=2, tensor=2), dict(data=4, context=2)],
                         ids=["data2_fsdp2_tensor2", "data4_context2"])
def test_qlora_on_sharded_meshes_equals_data_parallel(dirs, data_parallel, tmp_path, mesh):
  root, base = dirs
  keys = {f"mesh__{k}": v for k, v in mesh.items()}
  got = _train(_config(base, str(root / "a"), model__lora__base_dtype="nf4", **keys),
               tmp_path / "sharded")
  np.testing.assert_allclose(np.array(got), np.array(data_parallel), rtol=2e-5)


def test_the_float_base_gives_other_losses_than_the_nf4_one(dirs, data_parallel, tmp_path):
  """The negative control of the mesh test: the comparison sees the base's quantization."""
  root, base = dirs
  plain = _train(_config(base, str(root / "a")), tmp_path / "plain")
  assert abs(plain[0][0] - data_parallel[0][0]) > 1e-5


@pytest.mark.parametrize("mode", ["minibatch", "mixture"])
def test_minibatch_packing_and_mixtures_train_the_adapters_only(dirs, tmp_path, mode):
  root, base = dirs
  if mode == "minibatch":
    config = _config(base, str(root / "a"), packing__mode="minibatch",
                     packing__examples_per_batch=4)
  else:
    config = _config(base, f"a={root / 'a'}:0.7,b={root / 'b'}:0.3")
  run = setup_lib.setup(config, str(tmp_path / "run"))
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      run.state["params"])}
  assert names and all("lora_" in n for n in names)  # only adapters train
  before = jax.device_get(run.state["params"])
  for _ in range(2):
    run.state, metrics = run.train_step(run.state, next(_batches(run)))
    assert np.isfinite(float(metrics["loss"]))
  after = jax.device_get(run.state["params"])
  moved = [k for k, (x, y) in enumerate(zip(jax.tree.leaves(before), jax.tree.leaves(after)))
           if not np.array_equal(x, y)]
  assert len(moved) == len(jax.tree.leaves(before))  # every B and A moved
  run.checkpointer.close()


def _batches(run):
  from train import data as data_lib  # optional: the trainer's own batch reader
  from train import sharding as sharding_lib  # optional: as above
  while True:
    yield sharding_lib.global_batch(data_lib.next_batch(run.iterator), run.mesh)

"""`python -m train.export --adapter`: a run's LoRA adapters as a PEFT adapter directory.

The directory holds `adapter_config.json` (rank, alpha, dropout, the targets as PEFT's module
names, `base_model_name_or_path`: the run's `model.init_from`, made absolute) and
`adapter_model.safetensors` (PEFT's key names, float32), which
`peft.PeftModel.from_pretrained(base, DIR)` loads onto the base model and vLLM serves as a LoRA
module; `--config.model.init_adapter=DIR` continues from it. Written into `export`'s staging
directory, published as every export is (`train.export`).

Example: a rank-8 run on q and v of a 2-layer Llama writes 8 tensors,
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` `[8, E]`, ..., and
`"target_modules": ["q_proj", "v_proj"]`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from train.adapters import peft_files
from train.export.files import ExportError
from train.model import config as model_config
from train.runs import adapted
from train import sharding as sharding_lib

FILES = (peft_files.CONFIG_NAME, peft_files.WEIGHTS_NAME)  # what an adapter export writes


def adapter_tensors(adapters: dict[str, Any]) -> dict[tuple[int, str], tuple[np.ndarray, ...]]:
  """`(layer, target) -> (a_IxR, b_RxO)` of `adapted.flat_adapters`' paths, on the host."""
  out = {}
  for path, a in adapters.items():
    if not path.endswith("/lora/lora_a"):
      continue
    parts = path.split("/")  # layers/0/attn/q/lora/lora_a
    b = adapters[path.removesuffix("_a") + "_b"]
    out[(int(parts[1]), parts[3])] = (np.asarray(jax.device_get(a), np.float32),
                                      np.asarray(jax.device_get(b), np.float32))
  return out


def write(staging: str, checkpoint: Any, config: Any) -> tuple[list[str], int, int]:
  """Writes the adapter files into `staging`; returns `(files, tensors, bytes of tensors)`.

  Raises:
    ExportError: the run trained no adapters (`model.lora.rank` 0).
  """
  if not adapted.is_adapted(config):
    raise ExportError(
        "--adapter exports LoRA adapters, and this run trained every weight (model.lora.rank=0): "
        "export it without --adapter")
  mesh = sharding_lib.make_mesh(data=1, devices=jax.devices()[:1])
  _, adapters, _ = adapted.restore_adapters(checkpoint, config, mesh)
  tensors = adapter_tensors(adapted.flat_adapters(adapters))
  lora = model_config.architecture_fields(config.model)["lora"]
  base = config.model.init_from
  spec = peft_files.AdapterSpec(rank=lora.rank, alpha=float(lora.alpha),
                                targets=lora.target_names, dropout=float(lora.dropout),
                                base_model=None if base is None else os.path.abspath(base))
  files = peft_files.write_adapter(directory=staging, spec=spec, tensors=tensors)
  count = sum(len(pair) for pair in tensors.values())
  size = sum(x.nbytes for pair in tensors.values() for x in pair)
  return [os.path.basename(f) for f in files], count, size

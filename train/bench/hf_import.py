"""Host memory of importing a Hugging Face checkpoint: `python -m train.bench.hf_import [--json]`.

The import (`train.hf.weights.load_params`) reads tensors through memory-mapped safetensors one
at a time and places each straight onto the mesh with its sharding, in the checkpoint's dtype.
Its host memory above the process's baseline must stay within the largest tensor plus 10%,
beyond the parameters themselves. This command measures that on a Llama-family checkpoint of at
least `--size-gb` GB, which it writes itself, and prints the peak RSS beside the checkpoint size.

What is measured: the resident set (RSS) of a fresh process. RSS counts its anonymous memory
(NumPy buffers, the parameters) and the pages of a safetensors file while they are mapped and
touched. The loader maps a file for one tensor and unmaps it after the copy, so those pages count
only during that tensor's read. The kernel's page cache of an unmapped file is not counted (it is
reclaimable). On the CPU the loaded parameters live in host memory, so the loader's own cost is
the transient: peak above baseline minus the bytes of all loaded parameters. That difference is,
over the tensors, the largest of (a tensor's transient - the parameters loaded after it): exact
for the last tensor, `lm_head.weight` (as large as the largest), a lower bound for earlier ones.
The check is transient <= 1.1 x the largest tensor; it is meant for checkpoints of 1 GB and
more: at a few MB the runtime's own allocations (the first transfers, the allocator's pools)
weigh more than 10% of the largest tensor.

Algorithm:
  1. Choose the shapes: hidden 2048, 16 query / 8 key-value heads of 128, intermediate 5632,
     vocabulary 32000, an untied `lm_head`, and the fewest layers that reach `--size-gb`
     (hidden, heads, intermediate and vocabulary are halved while one layer overshoots a small
     size).
  2. Write `config.json` (`model_type` "llama"), one safetensors file per group of
     `train.hf.weights.tensor_map`'s tensors (the embedding; each layer; the final norm and
     `lm_head`) and `model.safetensors.index.json`, generating each file's random tensors just
     before writing it, so the writer holds one file at a time (numpy and safetensors only).
  3. In a fresh process (one CPU device, `JAX_PLATFORMS=cpu`): import JAX and the trainer, adopt
     the config and build the abstract model once (`nnx.eval_shape`), then record the baseline
     RSS (`/proc/self/status` VmRSS) and reset the peak to it (`/proc/self/clear_refs`).
  4. Load with `train.hf.weights.load_decoder` on the default mesh, wait for every parameter
     (`jax.block_until_ready`), and read the peak RSS (VmHWM since the reset) and the RSS.
     `getrusage`'s `ru_maxrss` is reported beside it; it cannot be reset, and Linux carries the
     starting process's peak into it across `exec`, so it can only be higher.
  5. Report the checkpoint and largest tensor bytes, the baseline, peak and final RSS, the
     parameter bytes (the sum of the loaded arrays' `nbytes`), the transient and the check, and
     the load time and GB/s; delete the checkpoint unless `--workdir` was given.

Example: the default 1.2 GB float32 checkpoint has 4 layers, 1.28 GB in 39 tensors, the largest
`model.embed_tokens.weight` and `lm_head.weight` of [32000, 2048] (262 MB each), so the
transient may be at most 288 MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from configs import packed
from segpack import errors
from train.hf import config as hf_config
from train.hf import weights as hf_weights
from train.model import decoder as model_lib
from train import sharding as sharding_lib

GB = 10**9
DTYPES = ("float32", "bfloat16")
BOUND = 1.1  # the transient may be at most BOUND x the largest tensor


@dataclasses.dataclass(frozen=True)
class Shapes:
  """A Llama-family model's sizes (the `config.json` keys they become in brackets)."""
  hidden: int = 2048  # E (hidden_size)
  heads: int = 16  # H (num_attention_heads)
  kv_heads: int = 8  # K (num_key_value_heads)
  head_dim: int = 128  # D (head_dim)
  intermediate: int = 5632  # F (intermediate_size)
  vocab: int = 32000  # V (vocab_size)
  layers: int = 1  # L (num_hidden_layers)

  def halved(self) -> Shapes:
    """Half the hidden size, heads, intermediate size and vocabulary (at least one head)."""
    return dataclasses.replace(self, hidden=self.hidden // 2, heads=max(1, self.heads // 2),
                               kv_heads=max(1, self.kv_heads // 2),
                               intermediate=self.intermediate // 2, vocab=self.vocab // 2)


def flax_shapes(s: Shapes) -> dict[str, tuple[int, ...]]:
  """segpack parameter path -> its shape (Flax kernels are `[in, out]`)."""
  q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
  out = {"embed/embedding": (s.vocab, s.hidden), "final_norm/scale": (s.hidden,),
         "lm_head/kernel": (s.hidden, s.vocab)}
  per_layer = {"attn_norm/scale": (s.hidden,), "mlp_norm/scale": (s.hidden,),
               "attn/q/kernel": (s.hidden, q), "attn/k/kernel": (s.hidden, kv),
               "attn/v/kernel": (s.hidden, kv), "attn/o/kernel": (q, s.hidden),
               "mlp/gate/kernel": (s.hidden, s.intermediate),
               "mlp/up/kernel": (s.hidden, s.intermediate),
               "mlp/down/kernel": (s.intermediate, s.hidden)}
  for n in range(s.layers):
    out.update({f"layers/{n}/{name}": shape for name, shape in per_layer.items()})
  return out


def file_groups(s: Shapes) -> list[dict[str, tuple[int, ...]]]:
  """The checkpoint's files (step 2): each a dict of Hugging Face tensor name -> torch shape
  (`[out, in]` for a Linear weight), in `train.hf.weights.tensor_map`'s names."""
  names = hf_weights.tensor_map(num_layers=s.layers, qkv_bias=False, qk_norm=False,
                                tie_embeddings=False)
  groups: list[dict[str, tuple[int, ...]]] = [{} for _ in range(s.layers + 2)]
  for path, shape in flax_shapes(s).items():
    tensor = names[path]
    parts = path.split("/")
    where = 0 if parts[0] == "embed" else int(parts[1]) + 1 if parts[0] == "layers" else -1
    groups[where][tensor.name] = tuple(reversed(shape)) if tensor.transpose else shape
  return groups


def _bytes(group: dict[str, tuple[int, ...]], itemsize: int) -> int:
  return sum(math.prod(shape) * itemsize for shape in group.values())


def choose_shapes(size_bytes: int, itemsize: int) -> Shapes:
  """Step 1: the `Shapes` of the smallest checkpoint of at least `size_bytes`."""
  if size_bytes <= 0:
    raise errors.UsageError(f"--size-gb: expected a size > 0, got {size_bytes / GB!r} GB")
  shapes = Shapes()
  while shapes.heads > 1 and sum(_bytes(g, itemsize) for g in file_groups(shapes)) > size_bytes:
    shapes = shapes.halved()
  fixed = sum(_bytes(g, itemsize) for g in file_groups(dataclasses.replace(shapes, layers=0)))
  per_layer = sum(_bytes(g, itemsize) for g in file_groups(shapes)) - fixed
  return dataclasses.replace(shapes, layers=max(1, math.ceil((size_bytes - fixed) / per_layer)))


def config_json(s: Shapes, dtype: str) -> dict[str, Any]:
  """The checkpoint's `config.json` (a transformers `LlamaConfig`)."""
  return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=s.hidden,
              num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
              num_hidden_layers=s.layers, intermediate_size=s.intermediate, vocab_size=s.vocab,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
              torch_dtype=dtype, max_position_embeddings=4096, hidden_act="silu",
              attention_bias=False, mlp_bias=False)


def write_checkpoint(model_dir: str, s: Shapes, dtype: str, *, seed: int = 0) -> dict[str, Any]:
  """Step 2: writes the checkpoint of `s` in `dtype` into `model_dir` (created).

  Returns:
    `checkpoint_bytes` (the tensors' bytes, the index's `total_size`), `file_bytes` (on disk),
    `largest_tensor`, `largest_tensor_bytes`, `num_tensors` and `num_files`.
  """
  np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
  itemsize = np.dtype(np_dtype).itemsize
  os.makedirs(model_dir, exist_ok=True)
  with open(os.path.join(model_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config_json(s, dtype), f, indent=2)
  rng = np.random.default_rng(seed)
  groups = file_groups(s)
  weight_map, file_bytes = {}, 0
  for i, group in enumerate(groups):
    name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    tensors = {t: (np.ones(shape, np_dtype) if len(shape) == 1 else
                   (rng.standard_normal(shape, np.float32) * 0.02).astype(np_dtype))
               for t, shape in group.items()}
    save_file(tensors, os.path.join(model_dir, name), metadata={"format": "pt"})
    del tensors
    weight_map.update(dict.fromkeys(group, name))
    file_bytes += os.path.getsize(os.path.join(model_dir, name))
  sizes = {t: math.prod(shape) * itemsize for g in groups for t, shape in g.items()}
  total = sum(sizes.values())
  with open(os.path.join(model_dir, hf_weights.INDEX_NAME), "w", encoding="utf-8") as f:
    json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f, indent=2)
  largest = max(sizes, key=sizes.get)
  return dict(checkpoint_bytes=total, file_bytes=file_bytes, largest_tensor=largest,
              largest_tensor_bytes=sizes[largest], num_tensors=len(sizes), num_files=len(groups))


def rss_bytes(field: str = "VmRSS") -> int:
  """A `/proc/self/status` size (`VmRSS`, `VmHWM`) in bytes."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise OSError(f"/proc/self/status has no {field} line")


def reset_peak() -> bool:
  """Resets the process's peak RSS to its RSS (Linux >= 4.0); False where it cannot."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
    return True
  except OSError:
    return False


def measure(model_dir: str) -> dict[str, Any]:
  """Steps 3-4, in a fresh process (`measure_in_subprocess`): loads `model_dir` onto the mesh."""
  config = packed.get_config()
  config.model.init_from = model_dir
  config.attention.implementation = "xla"
  hf_config.adopt(config)
  mesh = sharding_lib.make_mesh()
  model_lib.abstract(config, mesh=mesh)  # traced once before the baseline
  gc.collect()
  baseline = rss_bytes()
  peak_reset = reset_peak()
  peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  start = time.perf_counter()
  decoder = hf_weights.load_decoder(config, mesh=mesh)
  params = jax.block_until_ready(nnx.state(decoder, nnx.Param))
  seconds = time.perf_counter() - start
  ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  leaves = jax.tree.leaves(params)
  return dict(baseline_rss=baseline, ru_maxrss=ru_maxrss, ru_maxrss_before_load=peak_before,
              peak_rss=rss_bytes("VmHWM") if peak_reset else ru_maxrss,
              peak_source="VmHWM" if peak_reset else "ru_maxrss", rss_after=rss_bytes(),
              param_bytes=sum(int(x.nbytes) for x in leaves), num_params=len(leaves),
              param_dtype=str(config.model.param_dtype), load_seconds=seconds,
              num_devices=jax.device_count(), device=jax.devices()[0].platform)


def measure_in_subprocess(model_dir: str) -> dict[str, Any]:
  """Runs `measure` in a fresh Python on one CPU device; returns its result."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=1"])
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, "-m", "train.bench.hf_import", "--measure", model_dir],
                        env=env, cwd=root, capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"the measuring process ended with status {proc.returncode}:\n"
                       f"{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(*, size_gb: float, dtype: str, workdir: str | None, seed: int = 0) -> dict[str, Any]:
  """Steps 1-5: writes the checkpoint, measures its import; returns the JSON-able result."""
  if dtype not in DTYPES:
    raise errors.UsageError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
  itemsize = 4 if dtype == "float32" else 2
  shapes = choose_shapes(int(size_gb * GB), itemsize)
  root = workdir if workdir is not None else tempfile.mkdtemp(prefix="bench_hf_import_")
  model_dir = os.path.join(root, "checkpoint")
  try:
    written = write_checkpoint(model_dir, shapes, dtype, seed=seed)
    measured = measure_in_subprocess(model_dir)
  finally:
    if workdir is None:
      shutil.rmtree(root, ignore_errors=True)
  out: dict[str, Any] = dict(size_gb=size_gb, dtype=dtype, **dataclasses.asdict(shapes),
                             **written, **measured)
  out["peak_above_baseline"] = out["peak_rss"] - out["baseline_rss"]
  out["transient_bytes"] = out["peak_above_baseline"] - out["param_bytes"]
  out["bound_bytes"] = int(BOUND * out["largest_tensor_bytes"])
  out["transient_over_largest"] = out["transient_bytes"] / out["largest_tensor_bytes"]
  out["ok"] = out["transient_bytes"] <= out["bound_bytes"]
  out["retained_bytes"] = out["rss_after"] - out["baseline_rss"] - out["param_bytes"]
  out["gb_per_s"] = out["checkpoint_bytes"] / GB / out["load_seconds"]
  if workdir is not None:
    out["model_dir"] = model_dir
  return out


def _table(r: dict[str, Any]) -> str:
  mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
  rows = [
      ("checkpoint", f"{mb(r['checkpoint_bytes'])} in {r['num_tensors']} tensors, "
       f"{r['num_files']} files"),
      ("largest tensor", f"{mb(r['largest_tensor_bytes'])} ({r['largest_tensor']})"),
      ("baseline RSS", mb(r["baseline_rss"])),
      ("peak RSS", f"{mb(r['peak_rss'])} ({r['peak_source']}; ru_maxrss {mb(r['ru_maxrss'])})"),
      ("peak above baseline", mb(r["peak_above_baseline"])),
      ("parameters resident", f"{mb(r['param_bytes'])} ({r['num_params']} arrays, "
       f"{r['param_dtype']})"),
      ("loader transient", f"{mb(r['transient_bytes'])} = {r['transient_over_largest']:.3f} x "
       "the largest tensor"),
      (f"transient <= {BOUND} x largest", f"{'PASS' if r['ok'] else 'FAIL'} (bound "
       f"{mb(r['bound_bytes'])})"),
      ("RSS after the load", f"{mb(r['rss_after'])} (baseline + parameters + "
       f"{mb(r['retained_bytes'])})"),
      ("load time", f"{r['load_seconds']:.2f} s, {r['gb_per_s']:.2f} GB/s"),
  ]
  head = (f"Llama checkpoint, {r['dtype']}: hidden {r['hidden']}, {r['heads']}/{r['kv_heads']} "
          f"heads of {r['head_dim']}, intermediate {r['intermediate']}, vocab {r['vocab']}, "
          f"{r['layers']} layers; loaded onto {r['num_devices']} {r['device']} device(s)")
  width = max(len(k) for k, _ in rows)
  return "\n".join([head] + [f"{k:<{width}}  {v}" for k, v in rows])


def build_parser() -> argparse.ArgumentParser:
  """The `python -m train.bench.hf_import` parser."""
  parser = argparse.ArgumentParser(prog="python -m train.bench.hf_import", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size-gb", type=errors.at_least(0.001, float), default=1.2,
                      help="the checkpoint's least size, in GB (10^9 bytes)")
  parser.add_argument("--dtype", default="float32", choices=DTYPES, help="the tensors' dtype")
  parser.add_argument("--workdir", type=errors.directory, default=None,
                      help="write the checkpoint here and keep it (default: a temporary "
                      "directory, deleted)")
  parser.add_argument("--seed", type=int, default=0, help="the random tensors' seed")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # step 3's process
  return parser


@errors.command("python -m train.bench.hf_import")
def main(argv: Sequence[str] | None = None) -> int:
  """Runs `python -m train.bench.hf_import ...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  if args.measure is not None:
    print(json.dumps(measure(args.measure)))
    return 0
  result = bench(size_gb=args.size_gb, dtype=args.dtype, workdir=args.workdir, seed=args.seed)
  print(json.dumps(result, sort_keys=True) if args.json else _table(result))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""The cuDNN memory check: forward+backward temp memory at N and 2N against the workspace model.

JAX sizes cuDNN's packed layout as B x N sequences of the full row length S (N the static
`cudnn_segment_bound`), and the backward's workspace grows as B x N x H x S x D: 516 GiB at B = 2,
N = S = 4096, H = 16, K = 4, D = 128 (8.06 bytes per element); 66 GiB at H = K = 8, D = 64 (4.1)
(docs/attention.md, "The static bound N and its memory"). `cudnn_memory_check` compiles the
cuDNN backend at N and 2N and compares `compiled.memory_analysis()` with that model. Without
cuDNN it records `"unsupported: <reason>"`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from segpack.attention.cudnn import CudnnUnavailableError
from segpack.bench.gpu_cases import DTYPES, Case
from segpack.bench.gpu_checks import Attention, Compile, abstract_inputs, compile_now
from segpack.bench.gpu_checks import describe_error, vjp_all

# cuDNN backward workspace, bytes per element of B x N x H x S x D: 8.06 on an H100 (516 GiB at
# N = S = 4096), and a growth of 8.0625 from N = 32 to 64 on an H200 (jax 0.11.2, cuDNN 9.19; twice,
# docs/gpu/); 8.07 bounds both.
CUDNN_BYTES_PER_ELEMENT = 8.07


def cudnn_memory_check(*, batch: int = 2, seq_len: int = 4096, num_heads: int = 16,
                       num_kv_heads: int = 4, head_dim: int = 128, cudnn_segment_bound: int = 32,
                       dtype: str = "bfloat16", compiler: Compile = compile_now
                       ) -> dict[str, Any]:
  """cuDNN forward+backward temp memory at N and 2N against the workspace model.

  Model: `CUDNN_BYTES_PER_ELEMENT` (8.07) bytes per element of B x N x H x S x D, plus the
  arrays besides the workspace: out and dq and one more query-sized array (the unmasked output
  or the cotangent), dk and dv, and the float32 softmax statistics `[B, H, S]`. Passes when the
  temp bytes at N stay within the model and the growth from N to 2N, per added element, within
  8.07 bytes. Never raises.
  """
  rec: dict[str, Any] = dict(
      check="cudnn_memory", batch=batch, seq_len=seq_len, num_heads=num_heads,
      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
      cudnn_segment_bound=cudnn_segment_bound, bytes_per_element_max=CUDNN_BYTES_PER_ELEMENT)
  elements = batch * cudnn_segment_bound * num_heads * seq_len * head_dim
  item = jnp.dtype(DTYPES[dtype]).itemsize
  q_bytes = batch * seq_len * num_heads * head_dim * item
  kv_bytes = batch * seq_len * num_kv_heads * head_dim * item
  non_workspace = 3 * q_bytes + 2 * kv_bytes + 4 * batch * num_heads * seq_len
  case = Case(segment_ids=np.zeros((batch, seq_len), np.int32), row_kinds=(), seed=0,
              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
  temps = {}
  try:
    for n in (cudnn_segment_bound, 2 * cudnn_segment_bound):
      attn = Attention("cudnn", causal=True, cudnn_segment_bound=n)
      args = abstract_inputs(case, DTYPES[dtype])
      stats = compiler(("cudnn_memory", attn, dtype, case.shape),
                      functools.partial(vjp_all, attn), args).memory_analysis()
      if stats is None:
        raise RuntimeError("compiled.memory_analysis() returned None")
      temps[n] = int(stats.temp_size_in_bytes)
  except CudnnUnavailableError as e:
    return dict(rec, status=f"unsupported: {describe_error(e)}", failures=[])
  except Exception as e:  # pylint: disable=broad-except
    return dict(rec, status="failed", failures=[describe_error(e)])
  temp, temp_2n = temps[cudnn_segment_bound], temps[2 * cudnn_segment_bound]
  model = CUDNN_BYTES_PER_ELEMENT * elements + non_workspace
  slope = (temp_2n - temp) / elements
  failures = []
  if temp > model:
    failures.append(f"temp bytes {temp:,} > model {model:,.0f}")
  if slope > CUDNN_BYTES_PER_ELEMENT:
    failures.append(f"temp bytes grow by {slope:.3f} per B*N*H*S*D element from N to 2N, more "
                    f"than {CUDNN_BYTES_PER_ELEMENT}")
  return dict(rec, status="failed" if failures else "passed", failures=failures,
              workspace_elements=elements, non_workspace_bytes=non_workspace, model_bytes=model,
              temp_bytes=temp, temp_bytes_2n=temp_2n, bytes_per_element_growth=slope,
              implied_bytes_per_element=(temp - non_workspace) / elements)

"""Which rows of a global batch a process owns: one rule for both batch streams.

`StreamBatches` (global batches of the row stream) and `pack_minibatches` (one packed minibatch
per optimizer step) hand each process its part of every global batch by `process_block`, and
both name "this process of that many" with the keyword-only ints `process_index` and
`process_count`, checked by `check_processes`. Process `p` of `Q` owns the contiguous block
`[p*B/Q, (p+1)*B/Q)` of a batch of `B` rows: where `jax.make_array_from_process_local_data`
puts a process's rows when the batch axis is split over the mesh's `data` x `fsdp` devices in
process order, so the assembled global array is the global batch in order.
"""

from __future__ import annotations

from typing import Any

from segpack.data.options import PipelineConfigError, not_int

__all__ = ["check_processes", "process_block"]


def check_processes(fn: str, *, process_index: Any, process_count: Any) -> tuple[int, int]:
  """Validates "process `process_index` of `process_count`" and returns them as ints.

  Args:
    fn: the entry point's name, the first word of every message.
    process_index: this process, an int in `[0, process_count)`.
    process_count: the processes that split every global batch, an int >= 1.

  Returns:
    `(process_index, process_count)`.

  Raises:
    PipelineConfigError: naming the argument and echoing its value.
  """
  if not_int(process_count) or process_count < 1:
    raise PipelineConfigError(f"{fn}: process_count must be an int >= 1, got {process_count!r}")
  if not_int(process_index) or not 0 <= process_index < process_count:
    raise PipelineConfigError(
        f"{fn}: process_index must be an int in [0, {process_count}), got {process_index!r}")
  return int(process_index), int(process_count)


def process_block(num_rows: int, *, process_index: int, process_count: int) -> slice:
  """The rows of a global batch that process `process_index` of `process_count` owns.

  The block `[p*n, (p+1)*n)` with `n = num_rows / process_count`: the processes' blocks, in
  process order, are the whole batch in order. Example: 8 rows over 4 processes, process 2
  owns rows 4 and 5 (`slice(4, 6)`).

  Args:
    num_rows: rows of the global batch, a multiple of `process_count` (the callers check it,
      or round their batch up to one).
    process_index: this process, as `check_processes` returns it.
    process_count: the processes, as `check_processes` returns it.

  Returns:
    The slice of the global batch's rows.

  Raises:
    ValueError: `num_rows` is not a multiple of `process_count`.
  """
  if num_rows % process_count:
    raise ValueError(f"process_block: num_rows={num_rows} is not a multiple of "
                     f"process_count={process_count}")
  local = num_rows // process_count
  return slice(process_index * local, (process_index + 1) * local)

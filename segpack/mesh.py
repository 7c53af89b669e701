"""The device mesh axis names, shared by `segment_attention`'s defaults and the trainer.

One mesh with four axes: rows of a batch are split over `data` x `fsdp`, the slots of every row
over `context` (context parallelism: each device holds S / context slots of a row), parameters
over `fsdp` (ZeRO-3 style) and `tensor` (Megatron style: heads and the feed-forward dimension).
Attention splits its batch over `BATCH_AXES`, its heads over `TENSOR_AXIS` and, when given
`context_axis=CONTEXT_AXIS`, its sequence over `CONTEXT_AXIS`.
"""

from __future__ import annotations

__all__ = ["BATCH_AXES", "CONTEXT_AXIS", "DATA_AXIS", "FSDP_AXIS", "MESH_AXES", "TENSOR_AXIS"]

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
# The axis that splits the sequence of a row (context parallelism, `segment_attention`'s
# `context_axis`); the attention splits over it only when `context_axis` names it.
CONTEXT_AXIS = "context"
# Every axis of the trainer's mesh, in mesh order (`train.sharding.make_mesh`).
MESH_AXES = (DATA_AXIS, FSDP_AXIS, CONTEXT_AXIS, TENSOR_AXIS)
# The axes that split the rows of a batch.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)

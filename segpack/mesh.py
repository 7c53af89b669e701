"""The device mesh axis names, shared by `segment_attention`'s defaults and the trainer.

One mesh with three axes: rows of a batch are split over `data` x `fsdp`, parameters over `fsdp`
(ZeRO-3 style) and `tensor` (Megatron style: heads and the feed-forward dimension). Attention
splits its batch over `BATCH_AXES` and its heads over `TENSOR_AXIS`.
"""

from __future__ import annotations

__all__ = ["BATCH_AXES", "DATA_AXIS", "FSDP_AXIS", "MESH_AXES", "TENSOR_AXIS"]

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
# Every axis of the mesh, in mesh order.
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
# The axes that split the rows of a batch.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)

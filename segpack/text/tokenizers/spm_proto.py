"""The pieces of a SentencePiece model file, read from its protobuf wire format.

SentencePiece's own `sentencepiece_model_pb2` is generated for one protobuf runtime (0.2.3 needs
protobuf >= 7) and fails to import under an older one that other packages pin (apache-beam
needs < 7). The model file's layout is small and stable, so it is read here without protobuf:

  ModelProto:   field 1 (repeated, length-delimited) = SentencePiece
  SentencePiece: field 1 = piece (string), field 2 = score (float), field 3 = type (enum,
                 default NORMAL = 1; USER_DEFINED = 4)
"""

from __future__ import annotations

from segpack.errors import UserError

__all__ = ["ModelFormatError", "USER_DEFINED", "pieces", "user_defined_pieces"]

NORMAL, USER_DEFINED = 1, 4
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


class ModelFormatError(UserError, ValueError):
  """The bytes are not a SentencePiece model (truncated or another file)."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if pos >= len(buf):
      raise ModelFormatError(f"truncated varint at byte {pos}")
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return value, pos
    shift += 7


def _fields(buf: bytes):
  """(field number, wire type, value) of a message: ints for varints, bytes otherwise."""
  pos = 0
  while pos < len(buf):
    key, pos = _varint(buf, pos)
    number, wire = key >> 3, key & 7
    if wire == _VARINT:
      value, pos = _varint(buf, pos)
    elif wire == _BYTES:
      size, pos = _varint(buf, pos)
      value, pos = buf[pos:pos + size], pos + size
    elif wire in (_FIXED32, _FIXED64):
      size = 4 if wire == _FIXED32 else 8
      value, pos = buf[pos:pos + size], pos + size
    else:
      raise ModelFormatError(f"unsupported wire type {wire} at byte {pos}")
    if pos > len(buf):
      raise ModelFormatError(f"field {number} runs past the end ({pos} > {len(buf)} bytes)")
    yield number, wire, value


def pieces(model: bytes) -> list[tuple[str, int]]:
  """`(piece, type)` for every piece of the model, in id order."""
  out = []
  for number, wire, value in _fields(model):
    if number != 1 or wire != _BYTES:
      continue
    piece, kind = "", NORMAL
    for n, w, v in _fields(value):
      if n == 1 and w == _BYTES:
        piece = v.decode("utf-8")
      elif n == 3 and w == _VARINT:
        kind = v
    out.append((piece, kind))
  return out


def user_defined_pieces(model: bytes) -> dict[str, int]:
  """`{piece: id}` of the model's user-defined symbols (always encoded as that one piece)."""
  return {p: i for i, (p, kind) in enumerate(pieces(model)) if kind == USER_DEFINED}

# mypy: disable-error-code="arg-type"
"""The tensor index of a GGUF file, read without its metadata.

llama.cpp's ``gguf.GGUFReader`` builds an object for every part of every metadata value
first; a tokenizer's vocabulary and merges are ~490k parts, 4.2 s on the AMX Xeon for
SmolLM2's file, paid by every worker start. The loader needs only the tensors, so this
walks the metadata by its lengths (strings and arrays are skipped, never decoded), reads
the tensor infos, and maps each tensor's bytes; the format's constants are the ``gguf``
package's. A file that is not a well-formed GGUF raises ``ConfigError`` naming it.

Layout (little-endian, version 2 or 3): ``GGUF``, version u32, tensor count u64, metadata
count u64; each metadata entry a string key, a u32 type, its value; each tensor info a
string name, u32 dims, u64 per dim (fastest first), u32 type, u64 offset into the data,
which starts at the next multiple of ``general.alignment`` (32 unless set)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from worker.config import ConfigError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
FIXED_SIZES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
               GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2, GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4,
               GGUFValueType.FLOAT32: 4, GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8,
               GGUFValueType.FLOAT64: 8}


@dataclass(frozen=True)
class IndexedTensor:
    name: str
    kind: str  # the GGML type's name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # slowest dimension first, as PyTorch's
    data: np.ndarray  # uint8 bytes: [rows, bytes per row] for 2-D tensors, flat otherwise


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.path, self.offset = buf, path, 0

    def take(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        except struct.error:
            raise self.malformed("it ends inside its header") from None
        self.offset += struct.calcsize(fmt)
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.offset + n > len(self.buf):
            raise self.malformed("a length in its header runs past the end of the file")
        self.offset += n

    def string(self) -> str:
        n = self.take("<Q")
        start = self.offset
        self.skip(n)
        try:
            return bytes(self.buf[start:self.offset]).decode()
        except UnicodeDecodeError:
            raise self.malformed("a name in its header is not UTF-8") from None

    def value_type(self) -> GGUFValueType:
        raw = self.take("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self.malformed(f"metadata value type {raw} is not one of GGUF's") from None

    def skip_value(self, kind: GGUFValueType, depth: int = 0) -> None:
        if kind in FIXED_SIZES:
            self.skip(FIXED_SIZES[kind])
        elif kind == GGUFValueType.STRING:
            self.skip(self.take("<Q"))
        else:  # ARRAY: item type, count, items (arrays of arrays are legal)
            if depth > 8:
                raise self.malformed("its metadata nests arrays more than 8 deep")
            item, count = self.value_type(), self.take("<Q")
            if item in FIXED_SIZES:
                self.skip(count * FIXED_SIZES[item])
            else:
                for _ in range(count):
                    self.skip_value(item, depth + 1)

    def malformed(self, why: str) -> ConfigError:
        return ConfigError(f"{self.path.name} is not a well-formed GGUF file: {why} (at byte {self.offset})")


def read_index(path: Path) -> list[IndexedTensor]:
    """Every tensor of the file at ``path``, its bytes a read-only memory map."""
    if path.stat().st_size < 24:  # np.memmap refuses an empty file
        raise ConfigError(f"{path.name} is not a well-formed GGUF file: it is shorter than GGUF's header")
    raw = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(raw), path)
    if bytes(cur.buf[:4]) != MAGIC:
        raise cur.malformed("it does not start with GGUF's magic")
    cur.offset = 4
    if (version := cur.take("<I")) not in VERSIONS:
        raise cur.malformed(f"version {version} (Kervan reads {' and '.join(map(str, VERSIONS))})")
    tensor_count, kv_count = cur.take("<Q"), cur.take("<Q")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key, kind = cur.string(), cur.value_type()
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = cur.take("<I")
        else:
            cur.skip_value(kind)
    if alignment <= 0 or alignment & (alignment - 1):
        raise cur.malformed(f"general.alignment {alignment} is not a power of two")
    infos = []
    for _ in range(tensor_count):
        name, n_dims = cur.string(), cur.take("<I")
        if not 1 <= n_dims <= 4:
            raise cur.malformed(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    data_start = -(-cur.offset // alignment) * alignment
    tensors, names = [], set()
    for name, dims, type_id, offset in infos:
        if name in names:
            raise cur.malformed(f"tensor {name!r} is listed twice")
        names.add(name)
        tensors.append(_tensor(raw, cur, name, dims, type_id, data_start + offset))
    return tensors


def _tensor(raw: np.ndarray, cur: _Cursor, name: str, dims: list[int], type_id: int, start: int) -> IndexedTensor:
    try:
        kind = GGMLQuantizationType(type_id)
    except ValueError:
        raise cur.malformed(f"tensor {name!r} has type {type_id}, not one of GGML's") from None
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise cur.malformed(f"tensor {name!r}: {dims[0]} columns are not whole blocks of {block}")
    row_bytes = dims[0] // block * block_bytes
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    if start + rows * row_bytes > len(raw):
        raise cur.malformed(f"tensor {name!r} runs past the end of the file")
    data = raw[start:start + rows * row_bytes]
    shape = tuple(reversed(dims))
    return IndexedTensor(name, kind.name, shape, data.reshape(rows, row_bytes) if len(dims) == 2 else data)

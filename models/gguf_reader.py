"""A GGUF file's metadata and tensor index, read in milliseconds; tensors memory-mapped.

Where it sits: `checkpoint.gguf_hf_config` (API process, jax-free) reads the metadata,
`gguf_loader` the tensors. The `gguf` package (llama.cpp's Python reader and writer)
supplies the format's constants; its `GGUFReader` is not used at load because it builds a
numpy view per string on opening: 3.8 s for SmolLM2's 98k tokenizer strings, against
~0.1 s here. The tests write files with the `gguf` package's writer and read them back.

Promises:
- `read_gguf(path)` parses the header, every key/value (tokenizer string arrays only when
  asked for: otherwise their length stands in for them) and every tensor's name, shape
  (numpy order: GGML lists the innermost dimension first), type and data offset;
- `GGUFFile.tensor_data(name)` is a read-only memory-mapped view of the tensor's bytes
  (float tensors in their dtype), so reading one tensor touches only its pages;
- a ValueError for a file that is not GGUF (bad magic, version < 2, truncated).
"""

import mmap
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_SCALARS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    type_name: str  # GGMLQuantizationType name: "F32", "Q4_1", ...
    offset: int  # from the start of the file
    num_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict
    tensors: dict[str, TensorInfo]

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: float types as their dtype, others as uint8 rows."""
        info = self.tensors[name]
        raw = np.memmap(self.path, np.uint8, "r", offset=info.offset, shape=(info.num_bytes,))
        dtype = _FLOAT_DTYPES.get(info.type_name)
        if dtype is not None:
            return raw.view(dtype).reshape(info.shape)
        return raw.reshape(info.shape[:-1] + (-1,))


class _Cursor:
    def __init__(self, buffer):
        self.buffer = buffer
        self.position = 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buffer, self.position)
        self.position += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        start = self.position
        self.position += length
        return self.buffer[start : self.position].decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buffer, position = self.buffer, self.position
        for _ in range(count):
            position += 8 + int.from_bytes(buffer[position : position + 8], "little")
        self.position = position

    def value(self, value_type: int, key: str, string_arrays):
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type != GGUFValueType.ARRAY:
            return self.scalar(_SCALARS[GGUFValueType(value_type)])
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type == GGUFValueType.STRING:
            if key in string_arrays:
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
            return count
        if item_type == GGUFValueType.ARRAY:
            return [self.value(GGUFValueType.ARRAY, key, string_arrays) for _ in range(count)]
        fmt = _SCALARS[GGUFValueType(item_type)]
        size = struct.calcsize(fmt)
        values = np.frombuffer(self.buffer, fmt, count, self.position).tolist()
        self.position += size * count
        return values


def read_gguf(path: str, string_arrays=()) -> GGUFFile:
    """Parse the file's metadata and tensor index (see the module promises)."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", head, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        # Mapped, not read: only the metadata pages at the front are touched here.
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    cursor.position = 24
    try:
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"), key, string_arrays)
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            qtype = GGMLQuantizationType(cursor.scalar("<I"))
            infos.append((name, dims, qtype, cursor.scalar("<Q")))
    except (struct.error, ValueError) as e:
        raise ValueError(f"{path}: truncated or corrupt GGUF metadata ({e})") from e
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cursor.position // alignment) * alignment
    tensors = {}
    for name, dims, qtype, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims))
        tensors[name] = TensorInfo(
            name=name,
            shape=tuple(int(n) for n in reversed(dims)),
            type_name=qtype.name,
            offset=data_start + offset,
            num_bytes=count // block_size * type_size,
        )
    return GGUFFile(path, metadata, tensors)

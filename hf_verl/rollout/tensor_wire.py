"""Zero-copy safetensors framing for weight buckets on the wire.

A weight-sync bucket travels as one safetensors body (the public format: an 8-byte little-endian
header length, a JSON header of `{name: {dtype, shape, data_offsets}}`, then the raw tensor bytes
back to back). Any safetensors writer can produce it and any reader can parse it; what this module
adds is doing both without copying tensor data in Python:

- :func:`encode` returns the header bytes and one `memoryview` per tensor over the tensor's own
  storage, so a socket `sendall` reads straight from the parameters (`safetensors.torch.save`
  first copies every tensor into one `bytes`);
- :func:`decode` parses a received body held in one `uint8` tensor and returns tensors that are
  views into it (a tensor whose offset is not aligned to its element size is copied alone), so
  the receiver holds one copy of the bucket, not the body plus a decoded copy.

Pure functions over bytes; no I/O.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import torch

_TO_SAFETENSORS = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in _TO_SAFETENSORS.items()}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class WireFormatError(ValueError):
    """A body that is not a well-formed safetensors bucket."""


def _raw(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def encode(pairs: Sequence[tuple[str, torch.Tensor]]) -> tuple[bytes, list[memoryview]]:
    """The safetensors framing of `pairs`: `(prefix, chunks)`, where `prefix` is the 8-byte length and
    JSON header and `chunks` are the tensors' bytes (views of CPU contiguous tensors, no copy).
    `len(prefix) + sum(len(c) for c in chunks)` is the body's length."""
    header: dict[str, dict] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name, tensor in pairs:
        if tensor.dtype not in _TO_SAFETENSORS:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot carry.")
        if name in header:
            raise ValueError(f"tensor name {name!r} appears twice in one bucket.")
        raw = _raw(tensor)
        header[name] = {"dtype": _TO_SAFETENSORS[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        chunks.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes so the data is aligned
    return struct.pack("<Q", len(text)) + text, chunks


def decode(body: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors body held in a 1-D `uint8` tensor, as views into it.

    Raises:
        WireFormatError: the header is missing, not JSON, names an unknown dtype, or its offsets do
            not tile the data exactly.
    """
    if body.dtype != torch.uint8 or body.dim() != 1:
        raise TypeError("decode() takes the body as a 1-D uint8 tensor.")
    total = body.numel()
    if total < 8:
        raise WireFormatError(f"body of {total} bytes is shorter than a safetensors header.")
    (n,) = struct.unpack("<Q", bytes(body[:8].numpy()))
    if n > _MAX_HEADER or 8 + n > total:
        raise WireFormatError(f"header length {n} does not fit a body of {total} bytes.")
    try:
        header = json.loads(bytes(body[8 : 8 + n].numpy()))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireFormatError(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise WireFormatError("header is not a JSON object.")
    header.pop("__metadata__", None)
    start, data_len = 8 + n, total - 8 - n
    entries = []
    for name, info in header.items():
        try:
            dtype = _FROM_SAFETENSORS[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WireFormatError(f"bad header entry for {name!r}: {info!r:.200}") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if not 0 <= begin <= end <= data_len or end - begin != numel * itemsize:
            raise WireFormatError(f"offsets {begin}..{end} of {name!r} do not match its shape {shape} "
                                  f"({info['dtype']}) within {data_len} data bytes.")
        entries.append((begin, end, name, dtype, shape, itemsize))
    entries.sort()
    cursor = 0
    for begin, end, name, *_ in entries:
        if begin != cursor:
            raise WireFormatError(f"tensor {name!r} starts at {begin}, expected {cursor}: the data has a gap or overlap.")
        cursor = end
    if cursor != data_len:
        raise WireFormatError(f"the header covers {cursor} of {data_len} data bytes.")
    out = {}
    for begin, end, name, dtype, shape, itemsize in entries:
        raw = body[start + begin : start + end]
        if (start + begin) % itemsize:
            raw = raw.clone()  # misaligned for its dtype (mixed dtypes): this one tensor is copied
        out[name] = raw.view(dtype).view(shape)
    return out

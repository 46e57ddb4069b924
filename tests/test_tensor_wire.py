"""The zero-copy safetensors framing of weight buckets (hf_verl.rollout.tensor_wire)."""

import json
import struct

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from hf_verl.rollout.tensor_wire import WireFormatError, decode, encode


def _mixed():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.half", torch.randn(7, generator=g).half()),  # 14 bytes: what follows is misaligned
        ("c.bf16", torch.randn(2, 3, generator=g).bfloat16()),
        ("d.ids", torch.arange(5, dtype=torch.int64)),
        ("e.mask", torch.tensor([True, False, True])),
        ("f.scalar", torch.tensor(2.5)),
        ("g.empty", torch.zeros(0, 4)),
        ("h.strided", torch.randn(4, 6, generator=g).t()),  # non-contiguous input
    ]


def _body(prefix, chunks) -> torch.Tensor:
    data = prefix + b"".join(bytes(c) for c in chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_round_trip_of_mixed_dtypes_and_shapes():
    pairs = _mixed()
    out = decode(_body(*encode(pairs)))
    assert list(out) == [n for n, _ in pairs]
    for name, t in pairs:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name


def test_interoperates_with_the_safetensors_library_both_ways():
    pairs = _mixed()
    ours = bytes(_body(*encode(pairs)).numpy())
    theirs = st_load(ours)  # the official reader accepts our framing
    for name, t in pairs:
        assert torch.equal(theirs[name], t), name
    official = st_save({n: t.contiguous() for n, t in pairs})  # and we read the official writer's
    back = decode(torch.frombuffer(bytearray(official), dtype=torch.uint8))
    for name, t in pairs:
        assert torch.equal(back[name], t), name


def test_encode_does_not_copy_and_decode_returns_views():
    w = torch.randn(64, 64)
    prefix, chunks = encode([("w", w)])
    assert len(chunks) == 1 and chunks[0].nbytes == w.numel() * 4
    w[0, 0] = 123.0  # the chunk reads the parameter's own memory
    assert struct.unpack("<f", bytes(chunks[0][:4]))[0] == 123.0
    body = _body(prefix, chunks)
    out = decode(body)
    lo, hi = body.data_ptr(), body.data_ptr() + body.numel()
    assert lo <= out["w"].data_ptr() < hi  # a view into the body, not a copy


def test_header_is_padded_so_data_is_aligned():
    prefix, _ = encode([("x", torch.ones(3))])
    assert len(prefix) % 8 == 0
    (n,) = struct.unpack("<Q", prefix[:8])
    assert json.loads(prefix[8 : 8 + n])["x"] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}


@pytest.mark.parametrize("mangle, message", [
    (lambda b: b[:5], "shorter than a safetensors header"),
    (lambda b: struct.pack("<Q", 10**9) + b[8:], "does not fit"),
    (lambda b: b[:8] + b"\xff" + b[9:], "not JSON"),
    (lambda b: b[:-4], "do not match its shape"),
    (lambda b: b + b"\0" * 8, "covers"),
])
def test_malformed_bodies_are_refused_with_the_reason(mangle, message):
    good = bytes(_body(*encode([("x", torch.ones(3)), ("y", torch.ones(2))])).numpy())
    with pytest.raises(WireFormatError, match=message):
        decode(torch.frombuffer(bytearray(mangle(good)), dtype=torch.uint8))


def test_duplicate_names_and_unsupported_dtypes_are_refused():
    with pytest.raises(ValueError, match="appears twice"):
        encode([("x", torch.ones(1)), ("x", torch.ones(1))])
    with pytest.raises(TypeError, match="safetensors cannot carry"):
        encode([("z", torch.ones(2, dtype=torch.complex64))])

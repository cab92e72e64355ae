"""Helpers for tests/views: raw safetensors parsing (no loader normalises anything), the
expected bytes of a converted tensor as the real torch computes them, xxhsum output parsing,
and MiniLM embeddings."""

import json
import re
import struct
import warnings
from pathlib import Path

import torch

from ckptfs_checkpoints import Layouts
from ckptfs_testlib import FLOAT_DTYPES, SERVED_DTYPE, served_form  # noqa: F401  (re-exported)
from minilm import NON_WEIGHT_FILES, SENTENCES, embed, load_model  # noqa: F401  (re-exported)

TARGETS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The safetensors dtype each torch dtype is served as (ckptfs_testlib.SERVED_DTYPE).
SAFETENSORS_DTYPE = SERVED_DTYPE

_UINT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --- what ckptfs must serve --------------------------------------------------------------


def converted(tensor: torch.Tensor, target) -> torch.Tensor:
    """What `--dtype TARGET` serves for TENSOR: floating tensors `.to(target)` by the real
    torch, everything else (integers, bool, complex) untouched."""
    if target is None or tensor.dtype not in FLOAT_DTYPES:
        return served_form(tensor)
    return tensor.to(target)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _torch_nan_patterns(src_pattern: torch.Tensor, target) -> set:
    """The bit patterns the real torch gives when converting the single NaN SRC_PATTERN (a
    1-element tensor of the source dtype) to TARGET, over its code paths: the scalar path
    (a 1-element tensor), the vectorised body and the scalar tail of a long tensor. Torch is
    not consistent here (e.g. float16 NaN -> float32 is 0x7FC00000 vectorised but 0x7FFFFFFF
    in the tail; float64 NaN -> bfloat16 is 0xFFFF vectorised but 0x7FC0 in the tail)."""
    as_int = _UINT_OF_SIZE[torch.empty((), dtype=target).element_size()]
    found = set()
    for n in (1, 7, 64, 4099):
        out = src_pattern.expand(n).contiguous().to(target).view(as_int)
        found |= set(out.tolist())
    return found


def assert_converted_bytes(actual: bytes, source: torch.Tensor, target, what: str) -> None:
    """ACTUAL (the served bytes) must be exactly `converted(source, target)`'s bytes, bit for
    bit for every element that is not NaN (finite values, ±inf, -0.0, subnormals, rounding
    ties, overflow, underflow). An element torch converts to NaN must be served as a NaN
    whose bit pattern is one of those the real torch produces for that source NaN (torch
    itself gives different patterns on different code paths, see _torch_nan_patterns)."""
    want = converted(source, target)
    want_bytes = tensor_bytes(want)
    if actual == want_bytes:
        return
    assert len(actual) == len(want_bytes), (
        f"{what}: {len(actual)} bytes served, torch's {want.dtype} tensor has {len(want_bytes)}"
    )
    if source.dtype not in FLOAT_DTYPES:
        first = next(i for i, (a, b) in enumerate(zip(actual, want_bytes)) if a != b)
        raise AssertionError(
            f"{what}: {source.dtype} must be served untouched; first difference at byte "
            f"{first}: expected 0x{want_bytes[first]:02x}, served 0x{actual[first]:02x}"
        )
    size = want.element_size()
    as_int = _UINT_OF_SIZE[size]
    got = torch.frombuffer(bytearray(actual), dtype=torch.uint8).view(as_int)
    exp = want.contiguous().reshape(-1).view(torch.uint8).view(as_int)
    differ = (got != exp).nonzero().flatten()

    is_float_out = want.dtype in FLOAT_DTYPES
    flat_src = source.contiguous().reshape(-1)
    if is_float_out:
        exp_nan = torch.isnan(want.contiguous().reshape(-1).float())
        got_nan = torch.isnan(got.view(want.dtype).float())
    problems = []
    cache = {}
    for i in differ.tolist():
        if is_float_out and bool(exp_nan[i]):
            if bool(got_nan[i]):
                src_elem = flat_src[i : i + 1].clone()
                key = tensor_bytes(src_elem)
                if key not in cache:
                    cache[key] = _torch_nan_patterns(src_elem, want.dtype)
                if int(got[i]) in cache[key]:
                    continue  # a NaN pattern torch itself produces for this NaN
        problems.append(i)
    if not problems:
        return
    mask = (1 << (8 * size)) - 1
    lines = []
    for i in problems[:12]:
        src_elem = flat_src[i : i + 1]
        src_bits = int.from_bytes(tensor_bytes(src_elem), "little")
        try:
            src_val = float(src_elem.float())
        except (RuntimeError, TypeError):
            src_val = src_elem.tolist()
        lines.append(
            f"  element {i}: source {source.dtype} 0x{src_bits:0{2 * src_elem.element_size()}x} "
            f"({src_val!r}) -> expected 0x{int(exp[i]) & mask:0{2 * size}x}, "
            f"served 0x{int(got[i]) & mask:0{2 * size}x}"
        )
    raise AssertionError(
        f"{what}: {len(problems)} of {exp.numel()} elements differ from torch's "
        f"{source.dtype}.to({want.dtype}):\n" + "\n".join(lines)
    )


# --- safetensors files, parsed by hand ----------------------------------------------------


def parse_safetensors(data: bytes, what: str) -> dict:
    """{key: (dtype, shape, raw bytes)} of a safetensors file's contents, in data order,
    checking the layout (header length, contiguous data_offsets covering the data exactly)."""
    assert len(data) >= 8, f"{what}: {len(data)} bytes"
    (hlen,) = struct.unpack("<Q", data[:8])
    assert 8 + hlen <= len(data), f"{what}: header length {hlen} beyond the file"
    header = json.loads(data[8 : 8 + hlen])
    assert header.get("__metadata__", {}).get("format") == "pt", f"{what}: format != pt"
    body = data[8 + hlen :]
    entries = sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"),
        key=lambda kv: kv[1]["data_offsets"][0],
    )
    out = {}
    pos = 0
    for key, info in entries:
        start, end = info["data_offsets"]
        assert start == pos, f"{what}: {key} starts at {start}, previous tensor ended at {pos}"
        out[key] = (info["dtype"], info["shape"], body[start:end])
        pos = end
    assert pos == len(body), f"{what}: data is {len(body)} bytes, tensors cover {pos}"
    return out


def expected_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --- Hugging Face shards ---------------------------------------------------------------

SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def check_sharded_tree(files: dict, want: dict, order: list, limit: int, hf_split, what: str) -> None:
    """FILES ({relative path: bytes} of a view) must be the Hugging Face split of WANT
    ({key: tensor as served}) taken in ORDER (the catalog order) at LIMIT bytes."""
    state = {k: want[k] for k in order}
    ref = hf_split(state, max_shard_size=limit)
    total = sum(expected_nbytes(t) for t in want.values())
    assert ref.metadata["total_size"] == total  # untied tensors: HF counts every byte

    top = {p for p in files if "/" not in p}
    shards = {p for p in top if SHARD_NAME.match(p)}
    tensor_files = {p for p in files if p.startswith("tensors/")}
    assert len(tensor_files) == len(want), f"{what}: tensors/ has {len(tensor_files)} files, want {len(want)}"

    if not ref.is_sharded:
        assert "model.safetensors" in top, f"{what}: one shard, but no model.safetensors ({sorted(top)})"
        assert not shards and "model.safetensors.index.json" not in top, (
            f"{what}: everything fits in one shard, yet {sorted(shards)} / index are served"
        )
        parsed = parse_safetensors(files["model.safetensors"], f"{what}: model.safetensors")
        assert set(parsed) == set(want), f"{what}: model.safetensors keys"
        for key, tensor in want.items():
            assert parsed[key][2] == tensor_bytes(tensor), f"{what}: bytes of {key}"
        return

    assert "model.safetensors" not in top, f"{what}: sharded view still serves model.safetensors"
    assert "model.safetensors.index.json" in top, f"{what}: no model.safetensors.index.json"
    assert shards == set(ref.filename_to_tensors), (
        f"{what}: shard files {sorted(shards)} != huggingface_hub's {sorted(ref.filename_to_tensors)}"
    )
    index = json.loads(files["model.safetensors.index.json"])
    assert set(index) >= {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == total, (
        f"{what}: total_size {index['metadata']['total_size']} != {total}"
    )
    assert index["weight_map"] == ref.tensor_to_filename, (
        f"{what}: weight_map differs from huggingface_hub's split: "
        + ", ".join(
            f"{k}: {index['weight_map'].get(k)} vs {v}"
            for k, v in ref.tensor_to_filename.items()
            if index["weight_map"].get(k) != v
        )[:2000]
    )
    for name, keys in ref.filename_to_tensors.items():
        parsed = parse_safetensors(files[name], f"{what}: {name}")
        assert set(parsed) == set(keys), (
            f"{what}: {name} holds {sorted(parsed)}, huggingface_hub puts {sorted(keys)} there"
        )
        for key in keys:
            assert parsed[key][2] == tensor_bytes(want[key]), f"{what}: bytes of {key} in {name}"


# --- xxhsum ------------------------------------------------------------------------------

XXH3_LINE = re.compile(r"^XXH3 \((?P<path>.+)\) = (?P<hex>[0-9a-f]{16})$")


def parse_xxh3_lines(text: str, what: str) -> dict:
    """{path: hex} of `xxhsum -H3` style output; every line must have that format."""
    found = {}
    for line in text.splitlines():
        m = XXH3_LINE.match(line)
        assert m, f"{what}: line not in xxhsum -H3 format: {line!r}"
        assert m["path"] not in found, f"{what}: {m['path']} listed twice"
        found[m["path"]] = m["hex"]
    return found


# --- models ------------------------------------------------------------------------------


def assert_same_embeddings(folder, want, what: str) -> None:
    model, tokenizer = load_model(folder)
    got = embed(model, tokenizer)
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: embeddings {got.dtype} {tuple(got.shape)} != {want.dtype} {tuple(want.shape)}"
    )
    assert torch.equal(got, want), (
        f"{what}: embeddings differ by up to {(got.float() - want.float()).abs().max()}"
    )


def read_tree(root: Path) -> dict:
    """{relative path: bytes} of every regular file under ROOT."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- checkpoints -------------------------------------------------------------------------


def _with_canonical_nans(t: torch.Tensor) -> torch.Tensor:
    """T with every NaN replaced by torch's canonical NaN of its dtype (float('nan') stored
    in that dtype); the contract covers that NaN, not arbitrary payloads."""
    nan = torch.tensor(float("nan"), dtype=t.dtype)
    as_int = _UINT_OF_SIZE[t.element_size()]
    bits = t.contiguous().view(as_int).clone()
    bits[torch.isnan(t.float())] = nan.reshape(1).view(as_int)[0]
    return bits.view(t.dtype)


def _all_bit_patterns(dtype) -> torch.Tensor:
    """Every value of a 8- or 16-bit float type (NaNs made canonical)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size == 1:
        t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    else:
        t = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return _with_canonical_nans(t)


def _f32_from_bits(bits) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _f64_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int64).view(torch.float64)


def float32_edge_values(g: torch.Generator) -> torch.Tensor:
    """Hand-picked and random float32 values covering the conversions to bf16 and fp16:
    specials, subnormals, exact rounding ties (even and odd), ±1 ulp around them, the
    fp16 overflow boundary and fp16/bf16 underflow."""
    f = float
    specials = [
        0.0, -0.0, f("inf"), f("-inf"), f("nan"), 1.0, -1.0, 0.1, -0.3333333,
        3.4028234663852886e38, -3.4028234663852886e38, 1.1754943508222875e-38,  # f32 max, min normal
        1.401298464324817e-45, -1.401298464324817e-45, 1.1754942106924411e-38,  # min/max subnormal
        65504.0, -65504.0, 65505.0, 65519.0, 65519.99609375, 65520.0, -65520.0, 65536.0, 1e6, -1e30,
        2.0**-14, 2.0**-24, -(2.0**-24), 2.0**-25, -(2.0**-25), 2.0**-26, 1e-8, 3 * 2.0**-26,
        2.0**-133, 2.0**-134, 1e-40, -1e-40,
    ]
    parts = [torch.tensor(specials, dtype=torch.float32)]
    bits = []
    # bf16 rounding: upper 16 bits random (finite), lower 16 bits at / around the tie.
    upper = torch.randint(0, 0x7F80, (1500,), generator=g).tolist()
    for i, u in enumerate(upper):
        sign = 0x8000 if i % 2 else 0
        for low in (0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF):
            bits.append(((u | sign) << 16) | low)
    # bf16 tie right below the bf16 max: rounds to inf (odd) / the even neighbour.
    bits += [0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000, 0xFF7F8000, 0x00008000, 0x00018000, 0x80008000]
    # fp16 rounding in its normal range: f32 exponent 113..142, low 13 mantissa bits at the tie.
    for i in range(1500):
        e = 113 + int(torch.randint(0, 30, (1,), generator=g))
        m = int(torch.randint(0, 1 << 10, (1,), generator=g)) << 13
        sign = (i % 2) << 31
        for low in (0x1000, 0x0FFF, 0x1001, 0x0000):
            bits.append(sign | (e << 23) | m | low)
    # fp16 subnormal range: odd multiples of 2^-25 are ties between fp16 subnormals.
    for k in range(1, 2048, 2):
        x = k * 2.0**-25
        parts.append(torch.tensor([x, -x], dtype=torch.float32))
    parts.append(torch.tensor([k * 2.0**-25 for k in range(1, 2048, 2)], dtype=torch.float32).nextafter(
        torch.tensor(1.0)))
    parts.append(torch.tensor([k * 2.0**-25 for k in range(1, 2048, 2)], dtype=torch.float32).nextafter(
        torch.tensor(0.0)))
    # float32 subnormals, random, both signs.
    sub = torch.randint(1, 1 << 23, (2000,), generator=g)
    bits += sub.tolist() + (sub | (1 << 31)).tolist()
    parts.append(_f32_from_bits(bits))
    # Uniformly random bit patterns (every exponent), then ordinary values.
    rand_bits = torch.randint(-(2**31), 2**31, (60000,), generator=g, dtype=torch.int64)
    parts.append(rand_bits.to(torch.int32).view(torch.float32))
    parts.append(torch.randn(20000, generator=g) * 100)
    return _with_canonical_nans(torch.cat(parts))


def float64_edge_values(g: torch.Generator) -> torch.Tensor:
    """float64 values: specials, float64 subnormals, overflow beyond float32/fp16, the float32
    rounding boundary, and double-rounding cases (values a hair away from a bf16/fp16 tie
    that float32 rounds onto the tie)."""
    f = float
    f32max = 3.4028234663852886e38
    specials = [
        0.0, -0.0, f("inf"), f("-inf"), f("nan"), 5e-324, -5e-324, 2.2250738585072014e-308,
        1.7976931348623157e308, -1.7976931348623157e308, 1e300, 1e39, -1e39, f32max,
        3.4028235677973366e38, 3.4028235677973362e38, 3.402823567797337e38,  # f32 max + half ulp
        2.0**-149, 2.0**-150, -(2.0**-150), 2.0**-150 * (1 + 2.0**-52), 2.0**-151, 1e-46, 1e-300,
        65504.0, 65519.99999999, 65520.0, 65520.00000001, 2.0**-24, 2.0**-25, 2.0**-25 * (1 + 2.0**-40),
        0.1, 1 / 3, -2 / 3,
    ]
    parts = [torch.tensor(specials, dtype=torch.float64)]
    # Double rounding: start from float32 values exactly on a bf16 / fp16 tie, nudge them by
    # less than half a float32 ulp (float32 rounds back onto the tie).
    upper = torch.randint(0x0080, 0x7F00, (1000,), generator=g, dtype=torch.int64)
    tie_bits = (upper << 16) | 0x8000
    t32 = tie_bits.to(torch.int32).view(torch.float32).double()
    e = 113 + torch.randint(0, 30, (1000,), generator=g, dtype=torch.int64)
    m = torch.randint(0, 1 << 10, (1000,), generator=g, dtype=torch.int64) << 13
    t16 = ((e << 23) | m | 0x1000).to(torch.int32).view(torch.float32).double()
    for ties in (t32, t16):
        for rel in (2.0**-40, -(2.0**-40), 2.0**-30, -(2.0**-30), 0.0):
            parts.append(ties * (1 + rel))
            parts.append(-ties * (1 + rel))
    # Random values with exponents around the float32 range (and well outside it).
    n = 40000
    mant = torch.randint(0, 2**52, (n,), generator=g, dtype=torch.int64)
    exp = torch.randint(1023 - 160, 1023 + 160, (n,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 63
    parts.append(_f64_from_bits(sign | (exp << 52) | mant))
    # float64 subnormals and random full-range patterns.
    parts.append(_f64_from_bits(torch.randint(1, 2**52, (2000,), generator=g, dtype=torch.int64)))
    parts.append(_f64_from_bits(torch.randint(-(2**63), 2**63 - 1, (10000,), generator=g,
                                              dtype=torch.int64)))
    parts.append(torch.randn(10000, generator=g, dtype=torch.float64) * 1000)
    return _with_canonical_nans(torch.cat(parts))


def _complex32(t: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
        return t.to(torch.complex32)


def make_dtype_checkpoint(path: Path) -> None:
    """A torch.save'd training-style checkpoint with every float dtype (edge values and every
    bit pattern of the 8/16-bit types), tensors conversion must leave alone (integers, bool,
    complex), non-contiguous and storage-sharing views, a 0-dim and an empty tensor, and
    tensors large enough to span many conversion buffers and FUSE reads."""
    lay = Layouts(20261122)
    g = lay.g  # the edge values below draw from the same generator
    f32 = float32_edge_values(g)
    f64 = float64_edge_values(g)
    base = torch.randn(24, 40, generator=g)
    full16 = torch.randn(100, generator=g).to(torch.float16)
    big64 = torch.randn(1_200_000, generator=g, dtype=torch.float64) * 300
    big64[::9973] = f64[: big64[::9973].numel()]
    floats = {
        "f64": f64,
        "f32": f32,
        "f16": _all_bit_patterns(torch.float16),
        "bf16": _all_bit_patterns(torch.bfloat16),
        # The NaN torch's own float32 -> bfloat16 conversion writes (0xFFFF), as found in real
        # bf16 checkpoints, beside ordinary values.
        "bf16_torch_made": torch.cat([torch.full((40,), float("nan")),
                                      torch.randn(60, generator=g)]).to(torch.bfloat16),
        "f8_e4m3fn": _all_bit_patterns(torch.float8_e4m3fn),
        "f8_e5m2": _all_bit_patterns(torch.float8_e5m2),
        "f8_e4m3fnuz": _all_bit_patterns(torch.float8_e4m3fnuz),
        "f8_e5m2fnuz": _all_bit_patterns(torch.float8_e5m2fnuz),
        "f8_e8m0": _all_bit_patterns(torch.float8_e8m0fnu),
        "f32_2d": f32[: 300 * 41].reshape(300, 41),
        "f64_3d": f64[: 7 * 11 * 13].reshape(7, 11, 13),
        "scalar_f64": torch.tensor(2.0**-25 * (1 + 2.0**-40), dtype=torch.float64),
        "empty_f32": torch.zeros(0, 5),
    }
    views = {
        "transposed_f32": lay.transposed(base),  # (40, 24), strides (1, 40)
        "full_f16": full16,
        "window_f16": lay.window(full16, 11, 5, 8),  # shares full_f16's storage at an odd offset
        "big_f64": big64,
        "big_bf16": torch.randn(700_001, generator=g).to(torch.bfloat16),
    }
    untouched = {
        "i64": torch.randint(-(2**40), 2**40, (333,), generator=g),
        "i32": torch.randint(-(2**30), 2**30, (77,), generator=g, dtype=torch.int64).to(torch.int32),
        "i16": torch.randint(-(2**15), 2**15, (55,), generator=g).to(torch.int16),
        "i8": torch.randint(-128, 128, (33,), generator=g).to(torch.int8),
        "u8": torch.randint(0, 256, (35,), generator=g).to(torch.uint8),
        "bool": torch.rand(37, generator=g) > 0.5,
        "c64": torch.randn(6, 3, generator=g, dtype=torch.complex64),
        "c128": torch.randn(5, generator=g, dtype=torch.complex128),
        "c32": _complex32(torch.randn(4, generator=g, dtype=torch.complex64)),
    }
    torch.save({"floats": floats, "views": views, "ints": untouched, "epoch": 4}, path)

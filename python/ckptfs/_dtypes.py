"""The element types ckptfs serves (safetensors' names, as ckptfs_tensor_info gives them) in
torch and numpy. Each framework is imported only when its table is asked for."""

from __future__ import annotations

from ._lib import CkptfsError

# Bytes per element of every served dtype.
ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "C64": 8,
}


def itemsize(name: str) -> int:
    if name not in ITEMSIZE:
        raise CkptfsError(f"unknown dtype {name}")
    return ITEMSIZE[name]


def torch_dtype(name: str):
    """The torch dtype of safetensors dtype NAME."""
    import torch

    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U64": getattr(torch, "uint64", None), "U32": getattr(torch, "uint32", None),
        "U16": getattr(torch, "uint16", None), "U8": torch.uint8,
        "BOOL": torch.bool, "C64": torch.complex64,
    }
    if table.get(name) is None:
        raise CkptfsError(f"torch {torch.__version__} has no dtype for {name}")
    return table[name]


def numpy_dtype(name: str):
    """The numpy dtype of safetensors dtype NAME (numpy has no bfloat16 or float8)."""
    import numpy as np

    table = {
        "F64": np.float64, "F32": np.float32, "F16": np.float16,
        "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
        "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
        "BOOL": np.bool_, "C64": np.complex64,
    }
    if name not in table:
        raise CkptfsError(f"numpy has no dtype for {name}: use framework=\"pt\", or dtype=\"fp32\" to convert")
    return np.dtype(table[name]).newbyteorder("<")


def dtype_option(dtype) -> str | None:
    """The dtype option's text: "bf16", or a torch/numpy dtype by its name (torch.bfloat16 ->
    "bfloat16"). libckptfs checks it, as it checks every option."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:  # a numpy dtype or scalar type (numpy.float16)
        import numpy

        return numpy.dtype(dtype).name
    except (ImportError, TypeError):
        return text

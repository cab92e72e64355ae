"""The element types of tensors as torch and numpy have them. libckptfs gives each tensor's
torch and numpy names, torch shape and item size (ckptfs_tensor_loading); each framework is
imported only when a tensor of it is made."""

from __future__ import annotations

from ._lib import SafetensorError


def torch_dtype(entry: dict):
    """The torch dtype of tensor ENTRY (its "torch_dtype" name) as served."""
    import torch

    dtype = getattr(torch, entry["torch_dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise SafetensorError(f"torch {torch.__version__} has no dtype for {entry['dtype']}")
    return dtype


def torch_shape(entry: dict) -> list:
    """The torch shape of tensor ENTRY, as libckptfs gives it (its served shape, but F4's
    last dimension in torch's float4_e2m1fn_x2 elements, two values each)."""
    return list(entry["torch_shape"])


def numpy_dtype(entry: dict):
    """The numpy dtype (little-endian) of tensor ENTRY as served, as libckptfs names it."""
    import numpy as np

    if entry["numpy_dtype"] is None:
        # F4 has no conversion (dtype= refuses it), so only torch can hold it.
        convert = "" if entry["dtype"] == "F4" else ', or dtype="fp32" to convert'
        raise SafetensorError(f"numpy has no dtype for {entry['dtype']}: use framework=\"pt\"{convert}")
    return np.dtype(entry["numpy_dtype"]).newbyteorder("<")


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

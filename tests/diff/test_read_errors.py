"""A side that fails while it is read (not when opened) is named in the one-line error."""

import os
import time

import pytest
import torch

from ckptfs._diff import _declared_diff
from ckptfs._lib import _library, last_error
from ckptfs._source import Source

# These tests load libckptfs.so into the test process.
pytestmark = pytest.mark.loads_libckptfs


@pytest.mark.parametrize("side", ["a", "b"])
def test_source_replaced_after_open_names_its_side(side, tmp_path):
    paths = {"a": tmp_path / "a.pt", "b": tmp_path / "b.pt"}
    for name, path in paths.items():
        torch.save({"w": torch.randn(1000)}, path)
    opened = {name: Source(path, {}) for name, path in paths.items()}
    try:
        # Same size, other bytes and a new mtime: the view notices the file is not the one indexed.
        changed = paths[side]
        data = bytearray(changed.read_bytes())
        data[-200] ^= 0xFF
        time.sleep(0.01)
        changed.write_bytes(bytes(data))
        os.utime(changed, ns=(time.time_ns(), time.time_ns()))
        diff = _declared_diff(_library())
        assert diff(opened["a"].ptr, opened["b"].ptr, b"{}") is None
        message = str(last_error())
        assert message.startswith(f"{changed}: ") and "\n" not in message, message
    finally:
        for source in opened.values():
            source.close()

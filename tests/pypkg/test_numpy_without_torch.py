"""framework="numpy" works in a process that never imports torch."""

import json
import subprocess
import sys

import ckptfs  # noqa: F401  (the installed package; `installed` checks where it comes from)

PROGRAM = r"""
import json, sys
import ckptfs
source = sys.argv[1]
out = {}
with ckptfs.safe_open(source, framework="numpy") as f:
    for key in f.keys():
        out[key] = f.get_tensor(key).tobytes().hex()
    out["slice"] = f.get_slice("model.embed.weight")[5:9, ::3].tobytes().hex()
    out["metadata"] = f.metadata()
print(json.dumps({"tensors": out, "torch_imported": "torch" in sys.modules}))
"""


def test_numpy_without_torch(sources):
    source, reference = sources["pt"]
    # The bf16 tensor has no numpy dtype: convert the floating tensors, as a numpy user would.
    program = PROGRAM.replace('framework="numpy")', 'framework="numpy", dtype="fp32")')
    result = subprocess.run([sys.executable, "-c", program, str(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["torch_imported"] is False
    import torch

    for key, want in reference.items():
        if want.is_floating_point():
            want = want.to(torch.float32)
        assert got["tensors"][key] == want.detach().contiguous().numpy().tobytes().hex(), key
    want_slice = reference["model.embed.weight"][5:9, ::3].detach().contiguous().numpy().tobytes().hex()
    assert got["tensors"]["slice"] == want_slice

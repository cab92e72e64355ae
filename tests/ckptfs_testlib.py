"""Helpers shared by the Python suites (compat, fuse, views, zero, device...): where the binary
is, the DeepSpeed checkpoints of the fixture cache, how keys flatten, the dtypes ckptfs
serves, and bit-for-bit comparison of tensors and safetensors files. pytest.ini puts tests/ on
the import path."""

import json
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptfs_fixture_cache import ZERO_CHECKPOINTS, FixtureGenerationError, cached_fixtures

REPO_ROOT = Path(__file__).resolve().parents[1]


def project_version() -> str:
    """The version project() gives in the top-level CMakeLists.txt: the one version number of
    the binary, the library, the .deb, the wheel and the User-Agent."""
    found = re.search(r"project\(ckptfs\s+VERSION\s+([0-9][0-9.]*)", (REPO_ROOT / "CMakeLists.txt").read_text())
    assert found, "no project(ckptfs VERSION ...) in CMakeLists.txt"
    return found.group(1)


def deadline_scale() -> float:
    """How much longer than on the normal build every deadline a test sets on ckptfs is.

    The suites' deadlines are written for the normal build; the sanitizer builds run the
    daemon and the command 3-15x slower (scripts/test-sanitized.sh and test-tsan.sh set
    CKPTFS_SANITIZED), and a deadline is only a bound on a hang, never what a test measures.
    CKPTFS_DEADLINE_SCALE overrides (e.g. 3 on a machine busy with other work)."""
    explicit = os.environ.get("CKPTFS_DEADLINE_SCALE")
    if explicit:
        return max(1.0, float(explicit))
    sanitized = os.environ.get("CKPTFS_SANITIZED", "")
    if "thread" in sanitized:
        return 10.0
    if sanitized:
        return 4.0
    return 1.0


def scaled(seconds: float) -> float:
    """SECONDS, a deadline written for the normal build, for the build under test."""
    return seconds * deadline_scale()
DEFAULT_BIN = REPO_ROOT / "build" / "ckptfs"


# The floating-point dtypes of torch that ckptfs reads (and converts with --dtype).
FLOAT_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
)

# torch dtype -> the safetensors dtype ckptfs serves it as (doc/CLI.md).
SERVED_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    # safetensors has no name for these: served as their real view with a trailing 2.
    torch.complex128: "F64",
    torch.complex32: "F16",
}

# Every torch dtype ckptfs reads, in the order of SERVED_DTYPE.
ALL_DTYPES = list(SERVED_DTYPE)
assert ALL_DTYPES[: len(FLOAT_DTYPES)] == list(FLOAT_DTYPES)


def served_form(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as ckptfs serves it without conversion: complex128/complex32 become their
    real view."""
    if tensor.dtype in (torch.complex128, torch.complex32):
        return torch.view_as_real(tensor)
    return tensor


# A ckptfs command that takes longer than this is hung: the test fails instead of the suite.
COMMAND_TIMEOUT_S = scaled(60)


# --- bounded subprocesses -------------------------------------------------------------


class Bounded:
    """Result of run_bounded: returncode (None when it timed out), stdout and stderr (str),
    stdout_bytes and stderr_bytes (the raw output)."""

    def __init__(self, argv, returncode, stdout_bytes, stderr_bytes, timed_out):
        self.argv = [str(a) for a in argv]
        self.returncode = returncode
        self.stdout_bytes = stdout_bytes
        self.stdout = stdout_bytes.decode(errors="replace")
        self.stderr_bytes = stderr_bytes
        self.stderr = stderr_bytes.decode(errors="replace")
        self.timed_out = timed_out

    def describe(self) -> str:
        status = "timed out" if self.timed_out else f"exited {self.returncode}"
        return f"{' '.join(self.argv)} {status}\nstdout: {self.stdout[:2000]!r}\nstderr: {self.stderr!r}"


def run_bounded(argv, timeout: float, **kwargs) -> Bounded:
    """subprocess.run with a timeout that cannot itself hang: after the deadline the process
    is killed and waited for at most 5 more seconds (a process stuck in the kernel on a dead
    FUSE mount may not die at once; we then leave it behind rather than block).
    A preloaded library (scripts/test-sanitized.sh preloads the ASan runtime into Python for
    tests that load libckptfs.so) is not passed on: the commands run here (ckptfs, which
    links its own sanitizer runtime, pgrep, fusermount3) do not need it, and pgrep
    deadlocked under it."""
    if "env" not in kwargs and "LD_PRELOAD" in os.environ:
        kwargs["env"] = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.Popen(
        [str(a) for a in argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = b"", b""
        timed_out = True
    return Bounded(argv, None if timed_out else proc.returncode, out, err, timed_out)


def ckptfs_path() -> Path:
    return Path(os.environ.get("CKPTFS_BIN", DEFAULT_BIN))


# Fixtures shared by the suites; each conftest.py imports them.


@pytest.fixture(scope="session")
def ckptfs_bin() -> Path:
    path = ckptfs_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(
            f"ckptfs binary not found at {path}: build it with "
            f"'cmake -S {REPO_ROOT} -B {REPO_ROOT}/build && cmake --build {REPO_ROOT}/build' "
            "or point CKPTFS_BIN at it",
            pytrace=False,
        )
    return path.resolve()


@pytest.fixture(scope="session", autouse=True)
def ckptfs_library():
    """libckptfs.so beside the binary under test (CKPTFS_BUILD_DIR, else the binary's folder),
    as $CKPTFS_LIB for the ckptfs package; autouse in the suites that import it."""
    if "CKPTFS_LIB" not in os.environ:
        build = os.environ.get("CKPTFS_BUILD_DIR") or str(ckptfs_path().parent)
        os.environ["CKPTFS_LIB"] = str(Path(build) / "libckptfs.so")
    lib = Path(os.environ["CKPTFS_LIB"])
    if not lib.is_file():
        pytest.fail(f"libckptfs.so not found at {lib}: build the ckptfs_shared target", pytrace=False)
    return lib


@pytest.fixture(scope="session")
def run_ckptfs(ckptfs_bin):
    """run_ckptfs(*args, check=True, timeout=COMMAND_TIMEOUT_S, env=None) ->
    subprocess.CompletedProcess with bytes stdout and stderr; returncode is None when the
    command ran past TIMEOUT (run_bounded). With CHECK, anything but exit 0 fails the test.
    The one way every suite runs a FUSE-free subcommand (ls, info, cat, export, hash...)."""

    def run(*args, check: bool = True, timeout: float = COMMAND_TIMEOUT_S, env=None) -> subprocess.CompletedProcess:
        kwargs = {} if env is None else {"env": env}
        res = run_bounded([ckptfs_bin, *args], timeout, **kwargs)
        if check and res.returncode != 0:
            pytest.fail(res.describe(), pytrace=False)
        return subprocess.CompletedProcess(res.argv, res.returncode, res.stdout_bytes, res.stderr_bytes)

    return run


def served_model_tensors(run_ckptfs, source, *options) -> dict:
    """{key: tensor} of the model the view of SOURCE serves at its root (`ckptfs cat`): its
    weights file, or every shard its index names (a sharded source keeps its shards)."""
    from safetensors.torch import load as load_bytes

    manifest = json.loads(run_ckptfs("cat", *options, source, "manifest.json").stdout)
    model_file = manifest["model_file"]
    if not model_file.endswith(".index.json"):
        return load_bytes(run_ckptfs("cat", *options, source, model_file).stdout)
    index = json.loads(run_ckptfs("cat", *options, source, model_file).stdout)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_bytes(run_ckptfs("cat", *options, source, shard).stdout))
    return tensors


@pytest.fixture(scope="session")
def ls_json(run_ckptfs):
    """ls_json(source) -> the parsed `ckptfs ls --json SOURCE` array."""

    def ls(source) -> list:
        entries = json.loads(run_ckptfs("ls", "--json", source).stdout)
        assert isinstance(entries, list), "ls --json must print a JSON array"
        return entries

    return ls


def cached_fixtures_or_fail(generator: Path, **kwargs) -> Path:
    """ckptfs_fixture_cache.cached_fixtures(GENERATOR, **KWARGS); a generator failure fails
    the test."""
    try:
        return cached_fixtures(generator, **kwargs)
    except FixtureGenerationError as error:
        pytest.fail(f"could not generate test fixtures: {error}", pytrace=False)


@pytest.fixture(scope="session")
def zero_fixtures_root() -> Path:
    """The folder of every DeepSpeed checkpoint of tests/zero/make_zero_checkpoints.py
    (<name>/checkpoint, engine_reference.pt, zero_to_fp32.pt, fixture.json), generated once
    per machine."""
    return cached_fixtures_or_fail(ZERO_CHECKPOINTS)


# How every test that compares a model loaded from a mount with a reference model loads both:
# float32, eager attention, eager experts (a mixture of experts' grouped matmul and the
# default attention pick kernels by what the machine has), in one process with one thread
# count. Two models loaded so from equal tensors give equal logits, bit for bit; a model made
# another way (built in memory, in another process, by another transformers, on other
# threads) need not, and proves nothing about ckptfs when it differs.
CAUSAL_LM_LOAD = {"dtype": torch.float32, "attn_implementation": "eager", "experts_implementation": "eager"}


def causal_lm(folder, **checked):
    """transformers' AutoModelForCausalLM.from_pretrained(FOLDER) loaded as CAUSAL_LM_LOAD
    says, in eval mode; CHECKED: output_loading_info=True gives (model, info)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), **CAUSAL_LM_LOAD, **checked)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.eval()
    return loaded


def logits_of(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def assert_same_logits(model, reference_folder, input_ids, what: str) -> None:
    """MODEL's logits on INPUT_IDS equal, bit for bit, those of the model from_pretrained loads
    from REFERENCE_FOLDER (the reference tool's own files) the same way in this process."""
    reference = causal_lm(reference_folder)
    assert type(model) is type(reference), f"{what}: {type(model).__name__} != {type(reference).__name__}"
    assert_bitwise_equal(logits_of(model, input_ids), logits_of(reference, input_ids), what)


def flatten_tensors_with_paths(obj, path=()) -> dict:
    """{flattened key: (path, tensor)} for every tensor in a nested checkpoint, keyed the way
    doc/CLI.md flattens them (containers joined with '.', ints in decimal)."""
    if isinstance(obj, torch.Tensor):
        return {".".join(str(p) for p in path): (list(path), obj)}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {}
    flat = {}
    for name, value in items:
        flat.update(flatten_tensors_with_paths(value, path + (name,)))
    return flat


def flatten_tensors(obj) -> dict:
    """{flattened key: tensor}."""
    return {key: tensor for key, (_, tensor) in flatten_tensors_with_paths(obj).items()}


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same dtype, same shape, same bytes (NaN payloads and -0.0 included)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    # reshape(-1) first: a 0-dim tensor cannot be viewed as bytes directly.
    actual_bytes = actual.contiguous().reshape(-1).view(torch.uint8)
    expected_bytes = expected.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(actual_bytes, expected_bytes):
        differing = (actual_bytes != expected_bytes).nonzero().flatten()
        raise AssertionError(
            f"{what}: {differing.numel()} of {expected_bytes.numel()} bytes differ, "
            f"first at byte {int(differing[0])}"
        )


def read_safetensors_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return length, json.loads(f.read(length))


def check_safetensors_file(path: Path, want: dict) -> None:
    """Load PATH with both safetensors entry points (and get_slice on 2-D tensors) and
    compare with WANT, {key: tensor}, bit for bit."""
    path = Path(path)
    header_len, header = read_safetensors_header(path)
    # transformers refuses files without format=pt; the writer pads the header to 8 bytes.
    assert header.get("__metadata__", {}).get("format") == "pt", f"{path.name}: format != pt"
    assert header_len % 8 == 0, f"{path.name}: header length {header_len} not a multiple of 8"
    assert set(header) - {"__metadata__"} == set(want), f"{path.name}: header keys differ"

    loaded = load_file(path)
    assert set(loaded) == set(want), f"{path.name}: keys differ"
    for key, tensor in want.items():
        assert_bitwise_equal(loaded[key], tensor, f"{path.name}[{key}] via load_file")

    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(want)
        for key, tensor in want.items():
            assert_bitwise_equal(f.get_tensor(key), tensor, f"{path.name}[{key}] via safe_open")
            # Partial reads go through get_slice; exercise them on 2-D tensors.
            if tensor.dim() == 2 and tensor.shape[0] > 1 and tensor.shape[1] > 1:
                part = f.get_slice(key)
                assert part.get_shape() == list(tensor.shape)
                assert_bitwise_equal(
                    part[1:, : tensor.shape[1] - 1],
                    tensor[1:, : tensor.shape[1] - 1],
                    f"{path.name}[{key}] via get_slice",
                )


def json_strings(node) -> set:
    """Every string (dict keys included) anywhere in a JSON document."""
    if isinstance(node, str):
        return {node}
    if isinstance(node, dict):
        found = set(node)
        for value in node.values():
            found |= json_strings(value)
        return found
    if isinstance(node, list):
        return set().union(*(json_strings(v) for v in node)) if node else set()
    return set()


def json_dicts(node):
    """Every JSON object anywhere in a document, depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from json_dicts(value)
    elif isinstance(node, list):
        for value in node:
            yield from json_dicts(value)

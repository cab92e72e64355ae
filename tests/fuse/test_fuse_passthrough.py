"""FUSE passthrough (doc/MOUNT.md, "Passthrough"): the files of a mount that are source files
unchanged are read by the kernel straight from the source files; every file ckptfs transforms
goes through the daemon, in the same mount, and every byte is exact either way.

Which path served a read is observed from outside: the daemon's own read(2) calls are counted
by the kernel (/proc/PID/io, rchar). Reading a file served by passthrough leaves that count
where it was; reading one through the copy path adds at least its size.

The folders are written by transformers' own save_pretrained (safetensors with "format": "pt",
one file and sharded with an index), beside a tokenizer file of a few MiB. Where the machine's
kernel or privileges do not allow passthrough, the tests that need it skip with the mount's
own reason; everything else runs everywhere."""

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import run_bounded
from fusetools import HELPER_TIMEOUT_S, daemon_pids, expect_errno

TOKENIZER_BYTES = 6 << 20
SLACK_BYTES = 256 << 10  # the daemon's own reads besides file data (the tokenizer is 24x more)


def save_llama(folder: Path, max_shard_size=None) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    # A tokenizer file of a few MiB: big enough that the daemon reading it shows.
    vocab = {f"tok{i:07d}": i for i in range(TOKENIZER_BYTES // 18)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("passthrough") / "llama"
    save_llama(folder)
    assert (folder / "model.safetensors").is_file()
    return folder


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("passthrough") / "llama-sharded"
    save_llama(folder, max_shard_size="300KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 2
    return folder


def status(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.ckptfs.passthrough"))


def kernel_lacks_passthrough() -> str | None:
    """Why this machine cannot have passthrough at all, or None: not root, a kernel before
    6.9, or a kernel config that leaves it out."""
    if os.geteuid() != 0:
        return "the kernel gives passthrough to CAP_SYS_ADMIN only (run as root)"
    release = os.uname().release
    if tuple(int(x) for x in re.findall(r"\d+", release)[:2]) < (6, 9):
        return f"Linux {release} is older than 6.9"
    config = Path(f"/boot/config-{release}")
    if config.is_file() and "CONFIG_FUSE_PASSTHROUGH=y" not in config.read_text():
        return f"{config} has no CONFIG_FUSE_PASSTHROUGH"
    return None


def require_passthrough(mnt: Path) -> dict:
    """The mount's passthrough status. Skips where the machine cannot have passthrough at all;
    elsewhere a mount without it fails the test (so a broken handshake cannot pass as a
    machine without the feature)."""
    st = status(mnt)
    if not st["active"]:
        why = kernel_lacks_passthrough()
        if why:
            pytest.skip(f"no passthrough on this machine: {why} ({st.get('why')})")
        pytest.fail(f"passthrough should be on here but is not: {st}", pytrace=False)
    return st


def daemon_rchar(mnt: Path, binary) -> int:
    pids = daemon_pids(mnt, binary)
    assert len(pids) == 1, f"daemons of {mnt}: {pids}"
    for line in Path(f"/proc/{pids[0]}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/PID/io")


def read_counting(mnt: Path, binary, path: Path) -> tuple[bytes, int]:
    """PATH's bytes, and what the daemon read(2) meanwhile."""
    before = daemon_rchar(mnt, binary)
    data = path.read_bytes()
    return data, daemon_rchar(mnt, binary) - before


def source_files_served_as_is(src: Path) -> list:
    """The source files a mount without a view serves unchanged: all but the weight index
    (the mount's own index stands in its place)."""
    return sorted(p.name for p in src.iterdir() if p.is_file() and not p.name.endswith(".index.json"))


@pytest.mark.parametrize("folder_fixture", ["hf_folder", "sharded_folder"])
def test_unchanged_files_are_read_by_the_kernel(request, folder_fixture, mounts, ckptfs_bin):
    src = request.getfixturevalue(folder_fixture)
    mnt = mounts.mount(src)
    st = require_passthrough(mnt)
    as_is = source_files_served_as_is(src)
    assert st["files"] == len(as_is), st

    for name in as_is:
        data, daemon_read = read_counting(mnt, ckptfs_bin, mnt / name)
        assert data == (src / name).read_bytes(), name
        assert daemon_read < SLACK_BYTES, f"{name}: the daemon read {daemon_read} bytes of a passthrough file"
    # The weight index is the mount's own: through the daemon, and it names the same shards.
    if (src / "model.safetensors.index.json").exists():
        served = json.loads((mnt / "model.safetensors.index.json").read_text())
        source = json.loads((src / "model.safetensors.index.json").read_text())
        assert served["weight_map"] == source["weight_map"]
    assert status(mnt)["opened_files"] == len(as_is)

    # Mapped reads (safetensors maps the file) are the source file's own.
    for shard in sorted(src.glob("*.safetensors")):
        got, want = load_file(mnt / shard.name), load_file(shard)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (shard.name, key)

    # The framework's loader on the mount: the same model as from the folder.
    from transformers import AutoModelForCausalLM

    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        want_logits = AutoModelForCausalLM.from_pretrained(src).eval()(ids).logits
        got_logits = AutoModelForCausalLM.from_pretrained(mnt).eval()(ids).logits
    assert torch.equal(got_logits, want_logits)

    info = run_bounded([ckptfs_bin, "info", mnt], HELPER_TIMEOUT_S)
    assert info.returncode == 0, info.describe()
    assert f"passthrough:  {len(as_is)} files served by the kernel" in info.stdout, info.stdout


def test_dtype_view_keeps_passthrough_for_unchanged_files_only(sharded_folder, mounts, ckptfs_bin):
    src = sharded_folder
    mnt = mounts.mount(src, None, "-o", "dtype=bf16")
    st = require_passthrough(mnt)
    # Every shard converts (all float32) and config.json says the served dtype: only the
    # tokenizer and the generation config are the source's files as they are.
    assert st["files"] == 2, st

    data, daemon_read = read_counting(mnt, ckptfs_bin, mnt / "tokenizer.json")
    assert data == (src / "tokenizer.json").read_bytes()
    assert daemon_read < SLACK_BYTES
    assert (mnt / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    config = json.loads((mnt / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"

    for shard in sorted(src.glob("model-*.safetensors")):
        data, daemon_read = read_counting(mnt, ckptfs_bin, mnt / shard.name)
        assert daemon_read >= shard.stat().st_size // 2, f"{shard.name}: converted, yet the daemon read only {daemon_read}"
        got, want = load_file(mnt / shard.name), load_file(shard)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key].to(torch.bfloat16)), (shard.name, key)
    assert status(mnt)["opened_files"] == 2


def test_passthrough_off_serves_everything_through_the_daemon(hf_folder, mounts, ckptfs_bin):
    src = hf_folder
    mnt = mounts.mount(src, None, "-o", "passthrough=off")
    st = status(mnt)
    assert not st["active"] and st["files"] == 0 and st["why"] == "-o passthrough=off", st
    for name in source_files_served_as_is(src):
        data, daemon_read = read_counting(mnt, ckptfs_bin, mnt / name)
        assert data == (src / name).read_bytes(), name
        assert daemon_read >= len(data), name
    info = run_bounded([ckptfs_bin, "info", mnt], HELPER_TIMEOUT_S)
    assert "passthrough:  none (-o passthrough=off)" in info.stdout, info.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="drops CAP_SYS_ADMIN from a root daemon")
@pytest.mark.parametrize("drop, why", [("1", "lacks CAP_SYS_ADMIN"), ("ask", "Operation not permitted")])
def test_daemon_without_sys_admin_reads_through_the_daemon(hf_folder, mounts, ckptfs_bin, drop, why):
    """An unprivileged daemon: this machine's /dev/fuse is root's, so no other user can mount at
    all; the daemon drops CAP_SYS_ADMIN instead, either before deciding (it then does not ask
    the kernel) or after (the kernel refuses the first backing file: the fallback)."""
    src = hf_folder
    env = dict(os.environ, CKPTFS_TEST_DROP_SYS_ADMIN=drop)
    mnt = mounts.mount(src, None, env=env)
    for name in source_files_served_as_is(src):
        data, daemon_read = read_counting(mnt, ckptfs_bin, mnt / name)
        assert data == (src / name).read_bytes(), name
        assert daemon_read >= len(data), name
    st = status(mnt)
    assert not st["active"] and why in st["why"], st
    got, want = load_file(mnt / "model.safetensors"), load_file(src / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_changed_sources(tmp_path, mounts, ckptfs_bin):
    """A source replaced by rename: an open file keeps the file it opened, a new open fails.
    Rewritten in place: new opens fail; an open file reads what the source holds now."""
    src = tmp_path / "llama"
    save_llama(src)
    original = (src / "tokenizer.json").read_bytes()
    mnt = mounts.mount(src)
    require_passthrough(mnt)

    with open(mnt / "tokenizer.json", "rb") as held:
        assert held.read(4096) == original[:4096]
        replacement = tmp_path / "tokenizer.new"
        replacement.write_bytes(original.replace(b"tok", b"TOK"))
        os.replace(replacement, src / "tokenizer.json")
        assert held.read() == original[4096:]
    expect_errno(errno.EIO, (mnt / "tokenizer.json").read_bytes)

    config = (src / "generation_config.json").read_bytes()
    with open(mnt / "generation_config.json", "rb") as held:
        rewritten = config.replace(b"{", b"[", 1)
        with open(src / "generation_config.json", "r+b") as f:
            f.write(rewritten)
        held.seek(0)
        assert held.read() == rewritten
    expect_errno(errno.EIO, (mnt / "generation_config.json").read_bytes)
    # The files that were not touched are served on.
    assert (mnt / "config.json").read_bytes() == (src / "config.json").read_bytes()

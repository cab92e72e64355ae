"""http:// and https:// sources served by a real nginx on loopback: a remote mount serves
exactly the bytes of the same checkpoint mounted from disk, the real loaders read it (torch,
safetensors, transformers' from_pretrained), building a catalog fetches a small part of the
object, a missing object or an untrusted certificate is one line at mount, a remount with the
disk cache fetches nothing, and every request names the project's version in its User-Agent."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ckptfs_testlib import flatten_tensors, project_version
from fusetools import MOUNT_TIMEOUT_S, mount_entry, run_bounded, tree_files
from minilm import encode, load_model


def assert_same_trees(local_root, remote_root, skip=("manifest.json",)):
    """Every file of both mounts, byte for byte (the manifest names its source, so it is
    compared without that)."""
    local, remote = tree_files(local_root), tree_files(remote_root)
    assert sorted(local) == sorted(remote)
    for name in local:
        if name in skip:
            continue
        assert local[name].read_bytes() == remote[name].read_bytes(), name
    ml = json.loads((local_root / "manifest.json").read_bytes())
    mr = json.loads((remote_root / "manifest.json").read_bytes())
    ml.pop("source")
    mr.pop("source")
    assert ml == mr


@pytest.mark.timeout(120)
def test_pt_mount_serves_the_bytes_of_torch_load(training_pt, nginx, mounts):
    url = nginx.url("training.pt")
    remote = mounts.mount(url)
    local = mounts.mount(training_pt)
    assert_same_trees(local, remote)
    want = flatten_tensors(torch.load(training_pt, weights_only=True))
    got = load_file(remote / "model.safetensors")
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor.contiguous()), key
    # The source URL, nothing else, names the mount; the manifest says where it came from.
    entry = mount_entry(remote)
    assert entry is not None and entry["source"] == url
    assert json.loads((remote / "manifest.json").read_bytes())["source"]["path"] == url


@pytest.mark.timeout(120)
def test_dtype_bf16_matches_the_local_mount(training_pt, nginx, mounts):
    remote = mounts.mount(nginx.url("training.pt"), None, "-o", "dtype=bf16")
    local = mounts.mount(training_pt, None, "-o", "dtype=bf16")
    assert_same_trees(local, remote)
    got = load_file(remote / "model.safetensors")
    assert got["model.proj.weight"].dtype == torch.bfloat16


@pytest.mark.timeout(240)
def test_sharded_safetensors_by_index_url(minilm_sharded, minilm_dir, nginx, mounts):
    url = nginx.url("minilm-sharded/model.safetensors.index.json")
    remote = mounts.mount(url)
    local = mounts.mount(minilm_sharded)
    assert_same_trees(local, remote)
    # The shards' tensors, as safetensors reads them from the served folder.
    want = {}
    index = json.loads((minilm_sharded / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        want.update(load_file(minilm_sharded / shard))
    got = {}  # served in the source's own shards, under their names
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(remote / shard))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    # config.json and the tokenizer files were found next to the index.
    model, tokenizer = load_model(remote)
    ref_model, ref_tokenizer = load_model(minilm_dir)
    ids, emb = encode(model, tokenizer)
    ref_ids, ref_emb = encode(ref_model, ref_tokenizer)
    assert torch.equal(ids, ref_ids) and torch.equal(emb, ref_emb)


@pytest.mark.timeout(240)
def test_bin_model_folder_url_loads_with_from_pretrained(minilm_bin, minilm_dir, nginx, mounts):
    # A folder URL (trailing slash): no listing over HTTP, so the Hugging Face names are probed.
    remote = mounts.mount(nginx.url("minilm-bin/"))
    local = mounts.mount(minilm_bin)
    assert_same_trees(local, remote)
    model, tokenizer = load_model(remote)
    ref_model, ref_tokenizer = load_model(minilm_dir)
    ids, emb = encode(model, tokenizer)
    ref_ids, ref_emb = encode(ref_model, ref_tokenizer)
    assert torch.equal(ids, ref_ids) and torch.equal(emb, ref_emb)


@pytest.mark.timeout(180)
def test_ls_of_a_remote_pt_fetches_a_few_percent(www, nginx, run_ckptfs):
    # ~64 MB in a handful of tensors: ls needs the zip directory and the pickle only.
    path = www / "big-ls.pt"
    g = torch.Generator().manual_seed(3)
    torch.save({f"layer{i}.weight": torch.randn(2048, 1024, generator=g) for i in range(8)}, path)
    size = path.stat().st_size
    mark = nginx.log_mark()
    res = run_ckptfs("ls", nginx.url("big-ls.pt"))
    assert b"layer7.weight" in res.stdout
    fetched = nginx.bytes_since(mark, "/big-ls.pt")
    assert 0 < fetched <= 0.03 * size, f"ls fetched {fetched} of {size} bytes"
    requests = nginx.requests_since(mark)
    # ckptfs info counts what it fetched: the same requests and bytes the server logged.
    mark_info = nginx.log_mark()
    counted = json.loads(run_ckptfs("info", "--json", nginx.url("big-ls.pt")).stdout)["fetched"]
    assert counted["bytes"] == nginx.bytes_since(mark_info) == fetched
    assert counted["requests"] == len(nginx.requests_since(mark_info)) and counted["retries"] == 0
    # HEAD, the first bytes, the zip directory, and one local header per tensor record.
    assert len(requests) <= 3 + 8, requests


@pytest.mark.timeout(60)
def test_missing_object_is_one_line_and_no_mount(nginx, mounts):
    mp = mounts.new_mountpoint()
    res = mounts.start([mounts.binary, nginx.url("no-such.pt"), mp], mp)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such.pt" in lines[0], res.stderr
    assert mount_entry(mp) is None


@pytest.mark.timeout(60)
def test_credentials_in_url_are_refused_without_echoing_them(run_ckptfs):
    res = run_ckptfs("ls", "http://user:s3cret@127.0.0.1:9/x.pt", check=False)
    assert res.returncode == 1 and b"s3cret" not in res.stderr and b"credentials" in res.stderr
    res = run_ckptfs("ls", "https://127.0.0.1:9/x.pt?X-Amz-Signature=s3cret", check=False)
    assert res.returncode == 1 and b"s3cret" not in res.stderr


@pytest.mark.timeout(180)
def test_remount_with_disk_cache_fetches_nothing(training_pt, nginx, mounts, tmp_path):
    cache = tmp_path / "cache"
    url = nginx.url("training.pt")
    first = mounts.mount(url, None, "-o", f"cache_dir={cache}")
    served = {n: p.read_bytes() for n, p in tree_files(first).items()}
    mounts.unmount(first)
    mark = nginx.log_mark()
    second = mounts.mount(url, None, "-o", f"cache_dir={cache}")
    again = {n: p.read_bytes() for n, p in tree_files(second).items()}
    assert again == served
    requests = nginx.requests_since(mark)
    assert requests and nginx.bytes_since(mark) == 0, requests
    assert all(method == "HEAD" for method, _, _, _ in requests), requests


def env_without_ca(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CURL_CA_BUNDLE", "AWS_CA_BUNDLE")}
    env.update(extra)
    return env


@pytest.mark.timeout(120)
def test_https_with_the_servers_ca_serves_the_same_bytes(training_pt, nginx_tls, mounts):
    url = nginx_tls.url("training.pt")
    remote = mounts.mount(url, None, env=env_without_ca(CURL_CA_BUNDLE=str(nginx_tls.ca_file)))
    local = mounts.mount(training_pt)
    assert_same_trees(local, remote)
    # Every byte went over TLS: nginx logged the ranges it sent on its https port.
    assert nginx_tls.bytes_since(0, "/training.pt") > 0
    # The same trust given by the option instead of the environment.
    by_option = mounts.mount(url, None, "-o", f"ca_file={nginx_tls.ca_file}", env=env_without_ca())
    assert_same_trees(local, by_option)


@pytest.mark.timeout(60)
def test_https_with_an_untrusted_certificate_is_one_line_and_no_mount(nginx_tls, mounts, tmp_path):
    url = nginx_tls.url("training.pt")
    mp = mounts.new_mountpoint()
    # Not retried: a certificate problem is not transient, so this ends at once.
    res = mounts.start([mounts.binary, url, mp], mp, timeout=20, env=env_without_ca())
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and url in lines[0] and "certificate" in lines[0], res.stderr
    assert mount_entry(mp) is None
    # A CA file that cannot be read is named, not a TLS failure.
    missing = tmp_path / "no-such-ca.pem"
    res = mounts.start([mounts.binary, url, mp], mp, timeout=20, env=env_without_ca(CURL_CA_BUNDLE=str(missing)))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "CURL_CA_BUNDLE" in lines[0], res.stderr
    assert mount_entry(mp) is None
    # -o ca_file= wins over the environment and is named as the origin when unreadable.
    res = mounts.start([mounts.binary, url, mp, "-o", f"ca_file={missing}"], mp, timeout=20,
                       env=env_without_ca(CURL_CA_BUNDLE=str(nginx_tls.ca_file)))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "ca_file" in lines[0], res.stderr
    assert mount_entry(mp) is None


def test_requests_name_the_project_version(training_pt, nginx, ckptfs_bin):
    version = project_version()
    res = run_bounded([ckptfs_bin, "--version"], MOUNT_TIMEOUT_S)
    assert res.stdout.strip() == f"ckptfs {version}", res.describe()
    mark = nginx.agents_mark()
    res = run_bounded([ckptfs_bin, "ls", nginx.url("training.pt")], MOUNT_TIMEOUT_S)
    assert res.returncode == 0, res.describe()
    agents = nginx.agents_since(mark)
    assert agents and set(agents) == {f"ckptfs/{version}"}, agents

"""s3:// sources in moto's S3 server on loopback, which checks every request's SigV4
signature: a DeepSpeed ZeRO folder, a torch.distributed.checkpoint folder and a Hugging Face
model folder uploaded to a bucket mount and serve exactly what their local mounts serve;
wrong credentials fail the mount with one line that holds no secret."""

import pytest

from ckptfs_fixture_cache import DCP_CHECKPOINTS
from ckptfs_testlib import cached_fixtures_or_fail, zero_fixtures_root  # noqa: F401
from fusetools import mount_entry
from test_remote_http import assert_same_trees

BUCKET = "checkpoints"


@pytest.fixture(scope="module")
def bucket(s3):
    s3.client().create_bucket(Bucket=BUCKET)
    return BUCKET


def check_same_as_local(s3, bucket, prefix, local_folder, mounts, *options):
    s3.upload_folder(bucket, prefix, local_folder)
    remote = mounts.mount(f"s3://{bucket}/{prefix}", None, *options, env=s3.env())
    local = mounts.mount(local_folder, None, *options)
    assert_same_trees(local, remote)
    assert mount_entry(remote)["source"] == f"s3://{bucket}/{prefix}"
    return remote


@pytest.mark.timeout(180)
def test_zero_folder(s3, bucket, zero_fixtures_root, mounts):  # noqa: F811
    folder = zero_fixtures_root / "w2-s3-fp16-sg8" / "checkpoint"
    remote = check_same_as_local(s3, bucket, "zero/w2-s3", folder, mounts)
    assert (remote / "model.safetensors").stat().st_size > 0


@pytest.mark.timeout(180)
def test_dcp_folder(s3, bucket, mounts):
    root = cached_fixtures_or_fail(DCP_CHECKPOINTS)
    check_same_as_local(s3, bucket, "dcp/fsdp2_ws2", root / "fsdp2_ws2", mounts, "-o", "dtype=bf16")


@pytest.mark.timeout(240)
def test_hf_folder(s3, bucket, minilm_sharded, mounts):
    check_same_as_local(s3, bucket, "hf/minilm", minilm_sharded, mounts)


@pytest.mark.timeout(60)
def test_wrong_credentials_fail_the_mount_with_one_line(s3, bucket, training_pt, mounts):
    s3.client().upload_file(str(training_pt), bucket, "single/training.pt")
    secret = "wrong-secret-0123456789"
    mp = mounts.new_mountpoint()
    res = mounts.start([mounts.binary, f"s3://{bucket}/single/training.pt", mp], mp,
                       env=s3.env(AWS_SECRET_ACCESS_KEY=secret))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "403" in lines[0] and "credentials" in lines[0], res.stderr
    assert secret not in res.stderr and s3.access_key not in res.stderr
    assert mount_entry(mp) is None
    # The right ones mount it.
    mounts.mount(f"s3://{bucket}/single/training.pt", None, env=s3.env())


@pytest.mark.timeout(60)
def test_credentials_from_a_profile_file(s3, bucket, training_pt, tmp_path, run_ckptfs):
    s3.client().upload_file(str(training_pt), bucket, "profile/training.pt")
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n\n"
                     f"[ckpt]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n")
    env = s3.env(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_PROFILE="ckpt")
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    res = run_ckptfs("ls", f"s3://{bucket}/profile/training.pt", env=env)
    assert b"model.proj.weight" in res.stdout
    env["AWS_PROFILE"] = "default"
    res = run_ckptfs("ls", f"s3://{bucket}/profile/training.pt", env=env, check=False)
    assert res.returncode == 1 and b"403" in res.stderr

"""Run folders of step folders, built from real DCP saves: the step served is the highest
numbered one, or the one Megatron's latest_checkpointed_iteration.txt names, and `ckptfs info`
says which, in its text and JSON output."""

import json
import shutil

from ckptfs_testlib import check_safetensors_file


def build_run(tmp_path, dcp_case, steps: dict):
    """RUN/<folder> = a copy of the case's checkpoint dir, for each folder -> case in STEPS."""
    run = tmp_path / "run"
    run.mkdir()
    for folder, name in steps.items():
        shutil.copytree(dcp_case(name).checkpoint_dir, run / folder)
    return run


def test_highest_step_is_served_and_info_says_so(tmp_path, dcp_case, run_ckptfs, mounts):
    # Numbers compared as numbers: step-900 < step-1000 although "9" > "1".
    run = build_run(tmp_path, dcp_case, {"step-900": "fsdp2_ws2", "step-1000": "st_tp_ws2"})
    text = run_ckptfs("info", run).stdout.decode()
    assert '"step_folder":"step-1000"' in text and '"step":1000' in text, text
    info = json.loads(run_ckptfs("info", "--json", run).stdout)
    dcp = info["metadata"]["dcp"]
    assert (dcp["step_folder"], dcp["step"], dcp["serialization"]) == ("step-1000", 1000, "safetensors"), dcp
    mnt = mounts.mount(run, None, "-o", "root=model")
    case = dcp_case("st_tp_ws2")
    want = {k[len("model.") :]: t for k, t in case.tensors.items() if k.startswith("model.")}
    check_safetensors_file(mnt / "model.safetensors", want)


def test_megatron_iteration_file_names_the_step(tmp_path, dcp_case, run_ckptfs):
    run = build_run(tmp_path, dcp_case, {"iter_0000100": "fsdp2_ws2", "iter_0000200": "tp_ws2"})
    (run / "latest_checkpointed_iteration.txt").write_text("100\n")
    dcp = json.loads(run_ckptfs("info", "--json", run).stdout)["metadata"]["dcp"]
    assert (dcp["step_folder"], dcp["step"]) == ("iter_0000100", 100), dcp
    keys = {e["key"] for e in json.loads(run_ckptfs("ls", "--json", run).stdout)}
    assert keys == set(dcp_case("fsdp2_ws2").tensors), sorted(keys)

"""The option table (include/ckptfs/options.hpp) walked through every front end: each option
with a valid value is taken by every front end that documents it (`ckptfs ls`, `ckptfs load`,
`ckptfs diff`, a real mount, ckptfs_open, ckptfs_load_into and ckptfs_diff through ctypes), a bad value is refused by each
with one line, and a front end that does not document an option refuses it. The table comes
from libckptfs.so itself (ckptfs_options()); the man page and doc/CLI.md must name every
option in it."""

import ctypes
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from ckptfs_testlib import REPO_ROOT
from fusetools import daemon_pids, mount_entry

# Every test here reads the option table through libckptfs.so (the `table` fixture).
pytestmark = pytest.mark.loads_libckptfs

SAMPLE = REPO_ROOT / "tests" / "data" / "sample-mlp-training.pt"
# catalog_cache writes entries into its folder: a folder of this run's own, removed after.
CATALOG_CACHE = Path(tempfile.gettempdir()) / f"ckptfs-option-table-catalogs-{os.getpid()}"


@pytest.fixture(scope="module", autouse=True)
def _remove_catalog_cache():
    yield
    shutil.rmtree(CATALOG_CACHE, ignore_errors=True)


# (valid, invalid) value of every value option. An option the table has and this test does
# not know fails test_the_test_knows_every_option: a new option gets its values here.
VALUES = {
    "dtype": ("bf16", "int8"),
    "root": ("model", ""),
    "shard_size": ("1MB", "10XB"),
    "moments": None,
    "optimizer": None,
    "checksums": None,
    "write": ("model,tensors", "weights"),
    "max_pickle": ("512MiB", "abc"),
    "max_pickle_memory": ("8GiB", "0"),
    "max_header": ("200MB", "-1"),
    "max_tensors": ("1000", "0"),
    "cache_size": ("64MiB", "0"),
    "cache_dir": ("/tmp/ckptfs-remote-cache", "relative/cache"),
    "cache_dir_size": ("1GiB", "0"),
    "ca_file": ("/etc/ssl/certs/ca-certificates.crt", "relative/ca.pem"),
    "readahead": ("8MiB", "fast"),
    "remote_timeout": ("5", "0"),
    "remote_retries": ("2", "21"),
    "catalog_cache": (str(CATALOG_CACHE), ""),
    "backend": ("host", "tpu"),
    "device": ("0", "-1"),
    "select": ("model.*", ""),
    "buffer_size": ("64KiB", "1KiB"),
    "buffers": ("2", "0"),
    "io_threads": ("1", "many"),
    "direct_io": None,
    "verify": None,
    "map": ("none", "relative/map.json"),
    "atol": ("0.01", "-1"),
    "rtol": ("1e-3", "nan"),
    "threads": ("2", "many"),
    "rows": ("5", "4097"),
    # A family of options (map.NAME=V): tried through its member MEMBERS["map."].
    "map.": ("4", ""),
    "passthrough": ("off", "on"),
}
MEMBERS = {"map.": "map.num_layers"}
SWITCHES = {name for name, values in VALUES.items() if values is None}
# What a switch given a value gets, in every spelling.
SWITCH_VALUE = "yes"


# --- libckptfs.so through ctypes ---------------------------------------------------------


class Library:
    """The C API calls this test needs, through python/ckptfs's ctypes declarations."""

    def __init__(self, path: Path):
        os.environ["CKPTFS_LIB"] = str(path)
        sys.path.insert(0, str(REPO_ROOT / "python"))
        import ckptfs

        self.lib = ckptfs._library()

    def table(self) -> list:
        return json.loads(self.lib.ckptfs_options())

    def error(self) -> str:
        return self.lib.ckptfs_last_error().decode(errors="replace")

    def open(self, source, options: dict):
        """(handle or None, tensor info or error line)."""
        handle = self.lib.ckptfs_open(os.fsencode(str(source)), json.dumps(options).encode())
        if not handle:
            return None, self.error()
        return handle, json.loads(self.lib.ckptfs_tensor_info(handle))

    def close(self, handle):
        self.lib.ckptfs_close(handle)

    def diff(self, a, b, options: dict):
        """(result, None) or (None, error line)."""
        function = self.lib.ckptfs_diff
        function.restype = ctypes.c_char_p
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p]
        text = function(a, b, json.dumps(options).encode())
        if text is None:
            return None, self.error()
        return json.loads(text), None

    def load_into(self, handle, info: list, options: dict):
        """Loads every tensor into host buffers (the host back end): (0, stats) or (-1, error)."""
        entries = [e for e in info if e["nbytes"]]
        buffers = [ctypes.create_string_buffer(e["nbytes"]) for e in entries]
        n = len(entries)
        rc = self.lib.ckptfs_load_into(
            handle, n, (ctypes.c_uint64 * n)(*[e["index"] for e in entries]),
            (ctypes.c_void_p * n)(*[ctypes.addressof(b) for b in buffers]),
            (ctypes.c_uint64 * n)(*[e["nbytes"] for e in entries]), b"host", 0, json.dumps(options).encode(),
        )
        if rc != 0:
            return rc, self.error()
        return rc, json.loads(self.lib.ckptfs_last_load_stats())


@pytest.fixture(scope="module")
def library(ckptfs_bin) -> Library:
    """libckptfs.so of the build under test: $CKPTFS_LIB, else beside the binary."""
    build = os.environ.get("CKPTFS_BUILD_DIR") or str(Path(ckptfs_bin).parent)
    path = Path(os.environ.get("CKPTFS_LIB") or Path(build) / "libckptfs.so")
    if not path.is_file():
        pytest.fail(f"libckptfs.so not found at {path}: build the ckptfs_shared target", pytrace=False)
    return Library(path)


@pytest.fixture(scope="module")
def table(library) -> dict:
    return {entry["name"]: entry for entry in library.table()}


def json_values(value: str) -> list:
    """The JSON forms of a valid VALUE: the string, and the number where it is one."""
    return [value, int(value)] if value.isdigit() else [value]


def summary(entries) -> list:
    """What every front end agrees on about a view's tensors."""
    return [(e["key"], e["dtype"], list(e["shape"]), e["nbytes"]) for e in entries]


def one_line(text: str, what: str) -> str:
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"{what}: expected one line, got {text!r}"
    return lines[0]


# --- the table itself ------------------------------------------------------------------


def test_the_test_knows_every_option(table):
    assert set(table) == set(VALUES), "options in the table and in VALUES differ"
    for name, entry in table.items():
        assert (entry["kind"] == "switch") == (name in SWITCHES), name
        assert entry["front_ends"], f"{name}: no front end takes it"
        assert entry["help"], name


# --- the command line ------------------------------------------------------------------


def member(name, entry):
    """(option name, table entry) to use: a family's member in place of the family."""
    if name not in MEMBERS:
        return name, entry
    option = MEMBERS[name]
    return option, dict(entry, flag="--" + option.replace("_", "-"))


def cli_forms(entry, value) -> list:
    """The argument lists that give ENTRY the valid VALUE on the command line."""
    if entry["kind"] == "switch":
        return [[entry["flag"]]]
    return [[entry["flag"], value], [f"{entry['flag']}={value}"]]


def cli_bad_form(entry, bad) -> list:
    if entry["kind"] == "switch":
        return [f"{entry['flag']}={SWITCH_VALUE}"]
    return [entry["flag"], bad]


# Every `ckptfs load` here runs on the host back end (no GPU needed); a later --backend wins.
LOAD = ["load", "--backend", "host"]


@pytest.mark.parametrize("name", sorted(VALUES))
def test_command_line(name, table, run_ckptfs, tmp_path):
    entry, (value, bad) = table[name], VALUES[name] or (None, None)
    name, entry = member(name, entry)
    # Each front end's command, and what follows SOURCE.
    commands = {"read_command": (["ls"], []), "export_command": (["export"], [tmp_path / "out"]),
                "load_command": (LOAD, []), "diff_command": (["diff"], [SAMPLE])}
    for front_end, (command, after) in commands.items():
        takes = front_end in entry["front_ends"]
        for form in cli_forms(entry, value) if takes else []:
            res = run_ckptfs(*command, *form, SAMPLE, *after, check=False)
            assert res.returncode == 0, f"{command} {form}: {res.stderr.decode(errors='replace')!r}"
        argv = [*command, *(cli_bad_form(entry, bad) if takes else cli_forms(entry, value)[0]), SAMPLE, *after]
        res = run_ckptfs(*argv, check=False)
        line = one_line(res.stderr.decode(errors="replace"), " ".join(map(str, argv)))
        assert res.returncode == 2, f"{argv}: exit {res.returncode}, {line!r}"
        assert line.startswith("ckptfs: ") and line.endswith("(see --help)"), line
        assert res.stdout == b"", f"{argv}: wrote to stdout"
        if not takes:
            assert f"unknown option '{entry['flag']}" in line, line


# --- the mount -------------------------------------------------------------------------


def mount_with(mounts, option: str):
    """`ckptfs SAMPLE MNT -o OPTION` with the suite's bounded, torn-down mounts:
    (mountpoint, result)."""
    mountpoint = mounts.new_mountpoint()
    return mountpoint, mounts.start([mounts.binary, SAMPLE, mountpoint, "-o", option], mountpoint)


def assert_refused(mounts, mountpoint, res, option: str) -> str:
    line = one_line(res.stderr, f"-o {option}")
    assert res.returncode == 1, f"-o {option}: {res.describe()}"
    assert line.startswith("ckptfs: "), line
    assert mount_entry(mountpoint) is None, f"-o {option}: something was mounted"
    assert daemon_pids(mountpoint, mounts.binary) == [], f"-o {option}: a daemon is left running"
    return line


@pytest.mark.parametrize("name", sorted(VALUES))
def test_mount(name, table, mounts, library):
    entry, (value, bad) = table[name], VALUES[name] or (None, None)
    name, entry = member(name, entry)
    switch = entry["kind"] == "switch"
    good = name if switch else f"{name}={value}"
    if "mount" not in entry["front_ends"]:
        mountpoint, res = mount_with(mounts, good)
        assert_refused(mounts, mountpoint, res, good)
        return
    mountpoint, res = mount_with(mounts, good)
    mounts.check_mounted(mountpoint, res)
    try:
        manifest = json.loads((mountpoint / "manifest.json").read_bytes())
    finally:
        mounts.unmount(mountpoint)
    # The mount and the C API present the same view for the same option; an option of the
    # mount alone (passthrough) changes no view: the C API's without it.
    takes_open = "open" in entry["front_ends"]
    handle, info = library.open(SAMPLE, {name: True if switch else value} if takes_open else {})
    assert handle, info
    library.close(handle)
    assert summary(manifest["tensors"]) == summary(info), f"-o {good}: the mount and ckptfs_open differ"

    wrong = f"{name}={SWITCH_VALUE}" if switch else f"{name}={bad}"
    mountpoint, res = mount_with(mounts, wrong)
    assert_refused(mounts, mountpoint, res, wrong)


# --- the C API -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(VALUES))
def test_c_api(name, table, library, run_ckptfs):
    entry, (value, bad) = table[name], VALUES[name] or (None, None)
    name, entry = member(name, entry)
    switch = entry["kind"] == "switch"
    goods = [True, False] if switch else json_values(value)
    wrong = SWITCH_VALUE if switch else bad

    for good in goods:
        handle, info = library.open(SAMPLE, {name: good})
        if "open" not in entry["front_ends"]:
            assert handle is None, f"ckptfs_open took {name}={good!r}"
            assert f"unknown option '{name}'" in one_line(info, name)
            continue
        assert handle, f"ckptfs_open {name}={good!r}: {info}"
        library.close(handle)
        if good is not False:
            # The C API and the command line present the same view for the same option.
            flags = cli_forms(entry, value)[0]
            cli = json.loads(run_ckptfs("ls", "--json", *flags, SAMPLE).stdout)
            assert summary(info) == summary(cli), f"{name}={good!r}: ckptfs_open and ckptfs ls differ"
    if "open" in entry["front_ends"]:
        handle, error = library.open(SAMPLE, {name: wrong})
        assert handle is None, f"ckptfs_open took {name}={wrong!r}"
        one_line(error, f"ckptfs_open {name}={wrong!r}")

    handle, info = library.open(SAMPLE, {})
    assert handle, info
    try:
        for good in goods:
            rc, got = library.load_into(handle, info, {name: good})
            if "load_into" not in entry["front_ends"]:
                assert rc == -1, f"ckptfs_load_into took {name}={good!r}"
                assert f"unknown option '{name}'" in one_line(got, name)
                continue
            assert rc == 0, f"ckptfs_load_into {name}={good!r}: {got}"
            assert got["bytes"] == sum(e["nbytes"] for e in info)
        if "load_into" in entry["front_ends"]:
            rc, error = library.load_into(handle, info, {name: wrong})
            assert rc == -1, f"ckptfs_load_into took {name}={wrong!r}"
            one_line(error, f"ckptfs_load_into {name}={wrong!r}")
        for good in goods:
            result, error = library.diff(handle, handle, {name: good})
            if "diff" not in entry["front_ends"]:
                assert result is None, f"ckptfs_diff took {name}={good!r}"
                assert f"unknown option '{name}'" in one_line(error, name)
                continue
            assert result is not None and result["equal"], f"ckptfs_diff {name}={good!r}: {error}"
        if "diff" in entry["front_ends"]:
            result, error = library.diff(handle, handle, {name: wrong})
            assert result is None, f"ckptfs_diff took {name}={wrong!r}"
            one_line(error, f"ckptfs_diff {name}={wrong!r}")
    finally:
        library.close(handle)


# --- the documentation -----------------------------------------------------------------


def man_text() -> str:
    """packaging/ckptfs.1 with roff's escaped hyphens and font changes undone."""
    text = (REPO_ROOT / "packaging" / "ckptfs.1").read_text()
    for escape, plain in (("\\-", "-"), ("\\fB", ""), ("\\fI", ""), ("\\fR", ""), ('"', "")):
        text = text.replace(escape, plain)
    return text


def test_docs_name_every_option(table):
    man = man_text()
    cli_doc = (REPO_ROOT / "doc" / "CLI.md").read_text()
    readme = (REPO_ROOT / "README.md").read_text()
    for name, entry in table.items():
        mount_only = entry["front_ends"] == ["mount"]  # no command-line flag to name
        assert mount_only or entry["flag"] in man, f"packaging/ckptfs.1 does not name {entry['flag']}"
        assert mount_only or entry["flag"] in cli_doc, f"doc/CLI.md does not name {entry['flag']}"
        assert entry["flag"] in readme or f"{name}=" in readme or f"`{name}`" in readme, (
            f"README.md does not name {name}"
        )
        if "mount" in entry["front_ends"]:
            mount_form = f"-o {name}" if entry["kind"] == "switch" or entry["family"] else f"-o {name}="
            assert mount_form in man, f"packaging/ckptfs.1 does not name {mount_form}"
            assert f"{name}" in cli_doc, f"doc/CLI.md does not name -o {name}"

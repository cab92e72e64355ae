"""pytest plugin for the tests that mount real ckptfs file systems (tests/fuse, views, corpus,
hardening, and any other test that asks for `mounts`). tests/conftest.py registers it.

Fixtures:
- `mounts`: a fusetools.Mounts; every mount it started is torn down after the test (fusermount3
  -u, else -uz, then the daemon is killed if it lingers), and the test errors if one could not
  be taken down cleanly;
- `mounts_class`: the Mounts subclass `mounts` builds; a suite overrides it (tests/views);
- `requires_fuse`: `mounts` asks for it. Where the machine cannot mount FUSE, every test that
  asks for it, directly or through another fixture, is skipped with the reason. A suite whose
  every test mounts asks for it from an autouse fixture (tests/fuse).

Deadlines are pytest-timeout's (pytest.ini: signal method, test bodies only). A body blocked
in the kernel on a FUSE request that its daemon never answers cannot run the SIGALRM handler;
the rescue below kills the daemons of this run's mounts once the deadline is well past, which
aborts their connections and frees the body, so the timeout fails the test and teardown runs.
Every mount left at the end of the session is torn down too."""

import faulthandler
import os
import sys
import threading
from pathlib import Path

import pytest

from ckptfs_testlib import ckptfs_bin  # noqa: F401  (`mounts` needs it in every suite)
from fusetools import Mounts, fuse_unavailable_reason, kill_every_daemon, teardown_every_mount

TESTS_DIR = Path(__file__).resolve().parent

# How long after killing the daemons the rescue waits for the test to come back before it
# tears down every mount and ends the run (the body is stuck somewhere a dead daemon does not
# free).
EXIT_AFTER_S = 30


def pytest_addoption(parser):
    parser.addini(
        "hung_body_grace",
        "seconds past a test's pytest-timeout deadline that the SIGALRM handler gets to fail it "
        "before the daemons of the run's mounts are killed to free a body stuck on one",
        default="15",
    )


def _suite(item) -> str:
    """The suite folder of ITEM ("tests/fuse"), for messages."""
    try:
        return "tests/" + Path(str(item.path)).resolve().relative_to(TESTS_DIR).parts[0]
    except ValueError:
        return item.nodeid


@pytest.fixture(scope="session")
def requires_fuse():
    """Skips the test where this machine cannot mount FUSE file systems (the collection hook
    below already skips the tests that ask for this fixture; this covers getfixturevalue)."""
    reason = fuse_unavailable_reason()
    if reason is not None:
        pytest.skip(f"mounts for real and cannot run here: {reason}")


@pytest.fixture
def mounts_class():
    """The class `mounts` builds: fusetools.Mounts, or a subclass where a suite overrides this."""
    return Mounts


@pytest.fixture
def mounts(requires_fuse, mounts_class, ckptfs_bin, tmp_path_factory):
    m = mounts_class(ckptfs_bin, tmp_path_factory)
    try:
        yield m
    finally:
        problems = m.teardown()
    if problems:
        pytest.fail("mount teardown: " + "\n".join(problems), pytrace=False)


def pytest_collection_modifyitems(config, items):
    reason = fuse_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true" and any("requires_fuse" in getattr(i, "fixturenames", ()) for i in items):
        # On CI a machine that lost FUSE must fail, not pass with every mount test skipped.
        raise pytest.UsageError(f"CI=true and this machine cannot mount: {reason}")
    for item in items:
        if "requires_fuse" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=f"{_suite(item)} mounts for real and cannot run here: {reason}"))


def pytest_sessionfinish(session, exitstatus):
    teardown_every_mount()


class _HungBodyRescue:
    """Watches the body of the running test while its pytest-timeout timer is set."""

    def __init__(self):
        self._finished = None

    def arm(self, item, timeout: float) -> None:
        self.disarm()
        self._finished = threading.Event()
        grace = float(item.config.getini("hung_body_grace"))
        threading.Thread(
            target=self._watch,
            args=(item.nodeid, timeout, grace, self._finished),
            name="ckptfs-hung-body-rescue",
            daemon=True,
        ).start()

    def disarm(self) -> None:
        if self._finished is not None:
            self._finished.set()
            self._finished = None

    @staticmethod
    def _watch(nodeid: str, timeout: float, grace: float, finished: threading.Event) -> None:
        if finished.wait(timeout + grace):
            return
        killed = kill_every_daemon()
        sys.stderr.write(
            f"\n{nodeid}: still running {grace:.0f}s past its {timeout:.0f}s deadline; "
            f"killed the daemons {killed} of the run's mounts to free calls blocked on them\n"
        )
        if finished.wait(EXIT_AFTER_S):
            return
        sys.stderr.write(f"{nodeid}: still stuck {EXIT_AFTER_S}s later; tearing down every mount and exiting\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        teardown_every_mount()
        sys.stderr.flush()
        os._exit(1)


_rescue = _HungBodyRescue()


# pytest-timeout's own implementations are trylast; returning None lets them set and cancel
# its timer as usual.
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    _rescue.arm(item, settings.timeout)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    _rescue.disarm()

"""Plugins of every suite under tests/. CTest runs each suite folder on its own
(`pytest tests/<suite>`); pytest.ini at the repository root makes that the rootdir, so this
file is loaded first in every run, and tests/ is on the import path."""

import pytest

from ckptfs_testlib import deadline_scale

pytest_plugins = ["ckptfs_mounts"]


def pytest_collection_modifyitems(config, items):
    # Each test's pytest-timeout deadline (its `timeout` marker, else pytest.ini's) scaled for
    # the build under test, like every deadline the helpers set (ckptfs_testlib.scaled).
    scale = deadline_scale()
    if scale == 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        given = None if marker is None else (marker.args[0] if marker.args else marker.kwargs.get("timeout"))
        base = default if given is None else float(given)
        if base > 0:
            item.add_marker(pytest.mark.timeout(base * scale), append=False)


def pytest_sessionfinish(session, exitstatus):
    # scripts/test-sanitized.sh's preloaded pass runs `-m loads_libckptfs` over every suite it
    # is asked for; a suite without such tests has nothing to do there, which is not a failure.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.getoption("markexpr") == "loads_libckptfs":
        session.exitstatus = pytest.ExitCode.OK

"""Plugins of every suite under tests/. CTest runs each suite folder on its own
(`pytest tests/<suite>`); pytest.ini at the repository root makes that the rootdir, so this
file is loaded first in every run, and tests/ is on the import path."""

pytest_plugins = ["ckptfs_mounts"]

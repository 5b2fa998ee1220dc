"""Multi-process tests: each spawns real gloo ranks on a 2-core machine shared with other work.

A rank that loses a race with the OS scheduler (a gloo timeout, a rendezvous that comes late)
is not a product bug, so each test here gets one retry (pytest-rerunfailures). A real failure
fails twice and still fails the run.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if "tests/dist/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.flaky(reruns=1, reruns_delay=1))

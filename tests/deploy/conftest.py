"""Deployment tests: start Helm's Go runtime once, before any test's fd-leak guard looks.

The first call into libhelm opens descriptors the Go runtime keeps for the process's life
(cgroup CPU quota files, its netpoller's epoll and eventfd); whichever test made that
first call would be blamed for them.
"""

from __future__ import annotations

import pytest

from tests.deploy.helpers import ENDPOINTS, render


@pytest.fixture(scope="session", autouse=True)
def helm_runtime_started() -> None:
    render({"endpoints": ENDPOINTS})

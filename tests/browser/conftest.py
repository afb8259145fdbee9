"""A browser test that fails names the browser and the Jupyter stack it ran on: a break
that comes with a new release (of Chromium, JupyterLab, the widget manager) reads as such."""

from __future__ import annotations

import pytest

from . import lab


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.get_closest_marker("browser"):
        report.sections.append(("browser and Jupyter stack", lab.versions()))

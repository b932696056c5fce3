"""tests/conftest.py's ``require``: a missing prerequisite skips a test locally and fails it under ``CI=true``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .conftest import pytest_runtest_setup, require


@pytest.mark.parametrize("ci", ["true", "TRUE"])
def test_a_missing_prerequisite_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="CI must run this test: no widget"):
        require(False, "no widget")


@pytest.mark.parametrize("ci", [None, "", "false", "1"])
def test_a_missing_prerequisite_skips_elsewhere(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="no widget"):
        require(False, "no widget")


def test_a_present_prerequisite_runs(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require(True, "no widget") is None


def test_the_requires_marker_goes_through_require(monkeypatch):
    monkeypatch.setenv("CI", "true")
    item = SimpleNamespace(iter_markers=lambda name: iter([pytest.mark.requires(False, "no widget").mark]
                                                          if name == "requires" else []))
    with pytest.raises(pytest.fail.Exception, match="no widget"):
        pytest_runtest_setup(item)

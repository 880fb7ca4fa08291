"""The tested dependency set (issue 34): the ranges come from meshd's own installed
requirements, and a node started with a package outside them says so, at start and in
its doctor report."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from meshd.node import dependencies
from meshd.node.dependencies import WATCHED, Untested, installed_versions, outside
from tests.cluster import Cluster

pytestmark = pytest.mark.timeout(60)


def test_a_version_outside_its_range_is_named_and_one_not_installed_is_not() -> None:
    ranges = {"llama-cpp-python": ">=0.3.36,<0.4", "mlx": ">=0.32,<0.33", "msgspec": "<0.23"}
    got = outside(
        ranges, {"llama-cpp-python": "0.4.0", "mlx": None, "msgspec": "0.22.0rc1", "x": "9"}
    )
    assert got == [Untested(name="llama-cpp-python", installed="0.4.0", tested=">=0.3.36,<0.4")]
    assert "llama-cpp-python 0.4.0 is installed" in got[0].line()
    assert outside({"msgspec": "<0.23"}, {"msgspec": "not a version"})[0].installed == (
        "not a version"
    )


def test_the_installed_meshd_bounds_every_package_it_reaches_into() -> None:
    ranges = dependencies.tested_ranges()  # (not imported by name: pytest would collect it)
    assert set(ranges) == set(WATCHED), ranges
    assert all("<" in spec for spec in ranges.values()), ranges
    # The suite runs in the set it tests: nothing here is outside.
    assert outside(ranges, installed_versions()) == []


def test_a_node_with_an_untested_msgspec_says_so_at_start_and_in_doctor(
    cluster: Cluster, tmp_path: Path
) -> None:
    # A distribution record earlier on the path is the version importlib.metadata
    # reports (the module itself still loads from site-packages, as after a partial
    # upgrade).
    shadow = tmp_path / "shadow"
    info = shadow / "msgspec-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: msgspec\nVersion: 0.1.0\n")
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    a = cluster.start("a", env={"PYTHONPATH": path})
    assert "msgspec 0.1.0 is installed; meshd was tested with" in a.log()
    report = httpx.get(a.api + "/v1/doctor", timeout=30).json()
    (finding,) = [f for f in report["findings"] if f["code"] == "untested_dependency"]
    assert finding["severity"] == "warning" and "constraints.txt" in finding["fix"]

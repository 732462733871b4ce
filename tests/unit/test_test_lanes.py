"""The suite's own lanes (tests/conftest.py): which xdist group each Prefect module lands in, the order the
tests run in, and which tests' session setups a worker starts (only its own lane's). If the choice broke, the
only signs otherwise would be a slower suite and a second set of shared runs in the log.

Run: .venv/bin/python -m pytest tests/unit/test_test_lanes.py -q
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import tests.conftest as suite


class _Item:
    """What the hooks read of a collected test: its fixtures, module, path and markers."""

    def __init__(self, name: str, module: str, fixtures: set[str], folder: str = "integration") -> None:
        self.name, self.module, self.fixturenames = name, module, sorted(fixtures)
        self.path = Path(os.sep.join(["", "repo", "tests", folder, f"{module}.py"]))
        self.own_markers: list[pytest.Mark] = []

    def add_marker(self, marker) -> None:
        self.own_markers.append(marker.mark)

    def get_closest_marker(self, name: str):
        return next((mark for mark in self.own_markers if mark.name == name), None)


def _collected() -> dict[str, _Item]:
    items = [
        _Item("shared_a", "test_pipeline", {"prefect_server", "stage_server"}),
        _Item("shared_b", "test_pipeline", {"prefect_server"}),  # its module reads the stage server: same lane
        _Item("solo", "test_flows", {"prefect_server", "store"}),
        _Item("run", "test_whole", {"prefect_server", "whole_run"}),
        _Item("plain", "test_store", {"store"}),
        _Item("unit", "test_units", set(), folder="unit"),
    ]
    suite.pytest_collection_modifyitems(items)
    return {item.name: item for item in items}


def test_prefect_modules_split_into_the_shared_lane_and_the_solo_lane_and_run_last():
    items = _collected()
    lanes = {name: suite.lane_of(item) for name, item in items.items()}
    assert lanes == {"shared_a": suite.PREFECT_LANE, "shared_b": suite.PREFECT_LANE, "run": suite.PREFECT_LANE,
                     "solo": suite.PREFECT_SOLO_LANE, "plain": None, "unit": None}
    assert all(item.get_closest_marker("slow") for name, item in items.items() if lanes[name])
    assert not items["plain"].get_closest_marker("slow")
    order = list(items)  # the sorted order: unit, other, the solo lane, the shared lane (a module together)
    assert order[:3] == ["unit", "plain", "solo"] and set(order[3:]) == {"shared_a", "shared_b", "run"}


@pytest.mark.parametrize("running, lane", [("solo", suite.PREFECT_SOLO_LANE), ("shared_a", suite.PREFECT_LANE)])
def test_an_xdist_worker_starts_only_its_own_lanes_setups(monkeypatch, running, lane):
    items = _collected()
    request = SimpleNamespace(session=SimpleNamespace(items=list(items.values())),
                              config=SimpleNamespace(workerinput={"workerid": "gw0"}))
    monkeypatch.setitem(suite._RUNNING, "item", items[running])
    chosen = suite.lane_items(request)
    assert chosen and all(suite.lane_of(item) == lane for item in chosen)
    assert {item.name for item in chosen} == {name for name, item in items.items() if suite.lane_of(item) == lane}


def test_one_process_starts_every_tests_setups(monkeypatch):
    items = _collected()
    request = SimpleNamespace(session=SimpleNamespace(items=list(items.values())), config=SimpleNamespace())
    monkeypatch.setitem(suite._RUNNING, "item", items["solo"])
    assert suite.lane_items(request) == list(items.values())

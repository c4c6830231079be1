"""recipes.run.context: what a launch checks of its config before anything starts."""

from __future__ import annotations

import os

import pytest
from jsonargparse import Namespace

from recipes.run.common import UsageError
from recipes.run.context import check_devices


def test_more_cpu_processes_than_cores_are_refused_naming_the_count_and_the_way_out(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with pytest.raises(UsageError) as refused:
        check_devices(Namespace(devices=4, accelerator="cpu"))
    assert str(refused.value) == ("trainer.devices=4 asks for 4 CPU processes, but this machine has 2 CPU cores "
                                  "(--oversubscribe true starts them anyway, one thread each).")


def test_oversubscribe_lets_them_start(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_devices(Namespace(devices=4, accelerator="cpu"), oversubscribe=True)
    check_devices(Namespace(devices="3", accelerator="cpu"), oversubscribe=True)


def test_as_many_as_the_cores_need_no_flag(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_devices(Namespace(devices=2, accelerator="cpu"))
    check_devices(Namespace(devices="auto", accelerator="cpu"))

"""Watching the config file: atomic-rename saves, in-place writes, symlinks, polling, bursts and no-op touches."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from appliance.supervisor.watch import PollingWatcher, WatchfilesWatcher, fingerprint


async def watch(watcher_class, path: Path, edit, **kwargs) -> int:
    """Start a watcher, run ``edit()`` and count the changes it reports within a short while."""
    stop = asyncio.Event()
    changes: list[int] = []
    seen = asyncio.Event()

    def on_change() -> None:
        changes.append(1)
        seen.set()

    watcher = watcher_class(path, on_change, stop, **kwargs)
    task = asyncio.create_task(watcher.run())
    await asyncio.sleep(0.3)  # let inotify set up its watches
    edit()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(seen.wait(), 5)
    await asyncio.sleep(0.5)  # a burst must not become several changes
    stop.set()
    await asyncio.wait_for(task, 5)
    return len(changes)


def atomic_save(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.swp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.mark.parametrize("watcher_class", [WatchfilesWatcher, PollingWatcher])
def test_atomic_rename_save_is_seen_once(tmp_path, watcher_class):
    path = tmp_path / "appliance.yaml"
    path.write_text("a: 1\n")
    kwargs = {"interval_s": 0.1} if watcher_class is PollingWatcher else {}
    assert asyncio.run(watch(watcher_class, path, lambda: atomic_save(path, "a: 2\n"), **kwargs)) == 1


@pytest.mark.parametrize("watcher_class", [WatchfilesWatcher, PollingWatcher])
def test_a_burst_of_writes_is_one_change(tmp_path, watcher_class):
    path = tmp_path / "appliance.yaml"
    path.write_text("a: 0\n")

    def burst() -> None:
        for index in range(20):
            path.write_text(f"a: {index + 1}\n")

    kwargs = {"interval_s": 0.1} if watcher_class is PollingWatcher else {}
    assert asyncio.run(watch(watcher_class, path, burst, **kwargs)) == 1


def test_touch_without_a_content_change_is_not_a_change(tmp_path):
    path = tmp_path / "appliance.yaml"
    path.write_text("a: 1\n")
    before = fingerprint(path)
    os.utime(path, ns=(1, 1))
    assert fingerprint(path) != before  # mtime is part of it ...
    assert asyncio.run(watch(WatchfilesWatcher, path, lambda: None)) == 0  # ... but nothing happened meanwhile


def test_a_symlinked_file_whose_target_is_replaced_elsewhere(tmp_path):
    """The operator's file is a symlink into another folder (config management): watch the target's folder too."""
    real = tmp_path / "store"
    real.mkdir()
    (real / "appliance.yaml").write_text("a: 1\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    link = etc / "appliance.yaml"
    link.symlink_to(real / "appliance.yaml")
    assert asyncio.run(watch(WatchfilesWatcher, link, lambda: atomic_save(real / "appliance.yaml", "a: 2\n"))) == 1


def test_fingerprint_of_a_missing_file_is_none(tmp_path):
    assert fingerprint(tmp_path / "nope.yaml") is None

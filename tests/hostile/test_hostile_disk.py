"""A state folder that cannot be written: a full disk (a real 1 MiB tmpfs filled to the last byte) and a read-only
one (a read-only tmpfs mounted over it). A model load rewrites the registry file; that write must never fail the
REGISTER or the DECODE that caused it: they are served, ``/v1/health`` and STATUS say ``degraded`` naming the
file and the error, and once the folder has room again the retry writes the current registry and health is ok.

Mounting needs CAP_SYS_ADMIN: where it is not permitted the tmpfs cases skip (saying so) and the
``injected-enospc`` case, which makes the writer's os-level write (``statefiles.write_all``) fail with ENOSPC,
runs the same checks.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from harness import running

from appliance.daemon import registry, statefiles

MOUNT = Path(f"/tmp/ap-disk-{os.getpid()}")
"""The tmpfs's mount point: the appliance's ``data_dir`` in the tmpfs cases (the socket stays elsewhere)."""
TMPFS_SIZE = "1m"  # room for the registry and the agents store (SQLite: its file, WAL and shared memory)
RECOVERY_S = statefiles.MAX_RETRY_S + 20.0  # the longest retry wait, plus a slow machine's slack
FILLER = "filler.bin"


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True, timeout=30)


class Disk:
    """A way to make the state folder unwritable (:meth:`break_it`) and writable again (:meth:`mend`)."""

    errno_name = "ENOSPC"
    shows_files = True  # the folder's files can be read while it is broken

    def break_it(self) -> None:
        raise NotImplementedError

    def mend(self) -> None:
        raise NotImplementedError


class FullTmpfs(Disk):
    """Fill the tmpfs with one file until ENOSPC; mend by deleting it."""

    def break_it(self) -> None:
        chunk = b"\0" * 4096
        with open(MOUNT / FILLER, "wb", buffering=0) as filler, pytest.raises(OSError) as raised:
            while True:
                filler.write(chunk)
        assert raised.value.errno == errno.ENOSPC, raised.value

    def mend(self) -> None:
        (MOUNT / FILLER).unlink()


class ReadOnlyTmpfs(Disk):
    """Mount a read-only tmpfs over the state folder (remounting it ``ro`` is refused while the lock file is open for
    writing); mend by unmounting it. While it is there the folder's files are hidden, not only unwritable."""

    errno_name = "EROFS"
    shows_files = False

    def break_it(self) -> None:
        mount("-t", "tmpfs", "-o", "ro,size=4k", "tmpfs", str(MOUNT))

    def mend(self) -> None:
        subprocess.run(["umount", str(MOUNT)], check=True, capture_output=True, timeout=30)


class InjectedNoSpace(Disk):
    """The writer's os-level write fails with ENOSPC (for machines where a tmpfs cannot be mounted)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def break_it(self) -> None:
        self.monkeypatch.setattr(statefiles, "write_all", no_space)

    def mend(self) -> None:
        self.monkeypatch.undo()


def no_space(fd: int, data: bytes) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextmanager
def tmpfs(skip_reason: str) -> Iterator[None]:
    """A :data:`TMPFS_SIZE` tmpfs at :data:`MOUNT`, unmounted at the end; skips with ``skip_reason`` when mounting is
    not permitted here."""
    MOUNT.mkdir(exist_ok=True)
    try:
        mount("-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(MOUNT))
    except (OSError, subprocess.CalledProcessError) as exc:
        MOUNT.rmdir()
        detail = getattr(exc, "stderr", None) or exc
        pytest.skip(f"cannot mount a tmpfs here ({str(detail).strip()}): {skip_reason}")
    try:
        yield
    finally:
        unmounted = subprocess.run(["umount", str(MOUNT)], capture_output=True, text=True, timeout=30)
        if unmounted.returncode != 0:  # still in use: detach it anyway, and say so
            subprocess.run(["umount", "--lazy", str(MOUNT)], capture_output=True, timeout=30)
        MOUNT.rmdir()
        assert unmounted.returncode == 0, f"the tmpfs was still in use after the appliance stopped: {unmounted.stderr}"


@pytest.fixture
def disk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    """The case's :class:`Disk`. The tmpfs ones mount it at :data:`MOUNT` before the ``hostile`` fixture starts the
    appliance there (this fixture comes first in the test's arguments) and unmount it after it stopped."""
    kind = request.param
    if kind == "injected-enospc":
        yield InjectedNoSpace(monkeypatch)
        return
    with tmpfs("the injected-enospc case checks the same with an ENOSPC injected into the writer's os-level write "
               "instead of a real full disk"):
        yield FullTmpfs() if kind == "full-tmpfs" else ReadOnlyTmpfs()


def page(http: str, path: str) -> str:
    with urllib.request.urlopen(f"{http}{path}", timeout=30) as response:
        return response.read().decode()


def health(http: str) -> dict[str, Any]:
    return json.loads(page(http, "/v1/health"))


def temporaries(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith(".registry."))


def wait_for_ok(http: str) -> dict[str, Any]:
    deadline = time.monotonic() + RECOVERY_S
    doc = health(http)
    while doc["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.1)
        doc = health(http)
    return doc


ON_TMPFS = pytest.mark.hostile_config(data_dir=str(MOUNT))


@pytest.mark.parametrize("disk", [pytest.param("full-tmpfs", marks=ON_TMPFS),
                                  pytest.param("read-only-tmpfs", marks=ON_TMPFS),
                                  "injected-enospc"], indirect=True)
def test_an_unwritable_state_folder_fails_no_request(disk, hostile) -> None:  # type: ignore[no-untyped-def]
    state = hostile.state
    assert health(hostile.http)["status"] == "ok"
    before = registry.read(state)
    assert before is not None and before["models"]["demo-b"]["state"] == "available", before

    disk.break_it()
    reply = hostile.app.line("REGISTER disk-a demo-b", timeout=60)  # loads demo-b: the registry is rewritten
    assert reply.startswith("OK "), reply
    reply = hostile.app.line("DECODE disk-a 4 hello", timeout=60)
    assert reply.startswith("OK ") and "END_RESPONSE" in reply, reply
    reply = hostile.app.line("REGISTER disk-b demo-b", timeout=60)
    assert reply.startswith("OK "), reply

    doc = health(hostile.http)
    assert doc["status"] == "degraded", doc
    assert str(registry.path(state)) in doc["reason"] and disk.errno_name in doc["reason"], doc["reason"]
    [problem] = doc["state_files"]
    assert problem["file"] == str(registry.path(state)) and problem["errno"] == disk.errno_name, problem
    status = hostile.app.line("STATUS")
    assert "state_files status=degraded" in status and f"errno={disk.errno_name}" in status, status
    dashboard = page(hostile.http, "/admin/_dashboard")
    assert "state-problem" in dashboard and problem["reason"] in dashboard, dashboard[:2000]
    if disk.shows_files:
        assert temporaries(state) == [], "a failed write left its temporary file"
        assert registry.read(state) == before, "a failed write changed the registry file"

    disk.mend()
    doc = wait_for_ok(hostile.http)
    assert doc["status"] == "ok", f"still {doc['status']} {RECOVERY_S:g} s after the folder was writable: {doc}"
    assert doc["state_files"] == []
    assert "state_files status=ok" in hostile.app.line("STATUS")
    assert "state-problem" not in page(hostile.http, "/admin/_dashboard")
    after = registry.read(state)
    assert after is not None and after["models"]["demo-b"]["state"] == "loaded", after
    assert after["updated"] > before["updated"]
    assert temporaries(state) == []
    for agent in ("disk-a", "disk-b"):
        assert hostile.app.line(f"UNREGISTER {agent}").startswith("OK ")


def test_an_appliance_starts_on_a_full_state_folder_and_writes_its_registry_once_there_is_room(
        record_case: Callable[..., Any], tiny_model: Path) -> None:
    started = recovered = False
    disk = FullTmpfs()
    with tmpfs("a full disk at start-up needs a real one (the lock file's pid and the registry are written there)"):
        disk.break_it()
        try:
            with running({"demo": {"path": str(tiny_model), "n_ctx": 512}}, model_dirs=[tiny_model.parent],
                         data_dir=str(MOUNT)) as app:
                started = True
                http = app.appliance.http_url or ""
                doc = health(http)
                assert doc["status"] == "degraded" and str(registry.path(MOUNT)) in doc["reason"], doc
                assert app.line("REGISTER full-a demo", timeout=60).startswith("OK ")
                assert app.line("DECODE full-a 4 hello", timeout=60).startswith("OK ")
                disk.mend()
                doc = wait_for_ok(http)
                recovered = doc["status"] == "ok"
                assert recovered, f"still {doc['status']} {RECOVERY_S:g} s after the folder had room: {doc}"
                written = registry.read(MOUNT)
                assert written is not None and written["models"]["demo"]["state"] == "loaded", written
                assert app.line("UNREGISTER full-a").startswith("OK ")
        finally:
            record_case(crashed=not started, hung=started and not recovered)

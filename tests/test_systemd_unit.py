"""The systemd unit (SPEC S1): systemd-analyze verifies it and scores its sandbox, and the shipped config runs as
the unit installs it: config in a read-only folder, state and socket where --data-dir and --socket say.

systemd-analyze is required, not optional: scripts/setup.sh test installs Debian's systemd package when it can."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.client import lines as lineclient
from appliance.daemon import registry
from appliance.errors import ApplianceError

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "appliance.service"
SHIPPED_CONFIG = REPO / "appliance.yaml"
INSTALLED_BINARY = "/opt/appliance/.venv/bin/appliance"
"""Where the unit's ExecStart expects the program (README, "Install as a service")."""
CHECKOUT_BINARY = REPO / ".venv" / "bin" / "appliance"
MAX_EXPOSURE = 4.0
START_S = 120.0
"""Bound on writing the demo models and starting, on a slow box."""
REGISTRY_S = 30.0
STOP_S = 60.0
"""Bound on a graceful stop (the unit's TimeoutStopSec)."""


def systemd_analyze() -> str:
    """The systemd-analyze program; a missing one fails the test (it is a CI requirement, not an option)."""
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is not installed: install Debian's `systemd` package "
                    "(scripts/setup.sh test does when it runs as root or with passwordless sudo)")
    return found


@pytest.fixture
def unit_copy(tmp_path: Path) -> Path:
    """The shipped unit with ExecStart pointing at this checkout's binary (verify needs it to exist)."""
    text = UNIT.read_text()
    assert text.count(INSTALLED_BINARY) == 1, f"ExecStart should run {INSTALLED_BINARY}, once"
    assert CHECKOUT_BINARY.exists(), f"{CHECKOUT_BINARY} is missing: run scripts/setup.sh"
    copy = tmp_path / "appliance.service"
    copy.write_text(text.replace(INSTALLED_BINARY, str(CHECKOUT_BINARY)))
    return copy


def test_the_copy_differs_from_the_shipped_unit_only_in_the_binary_path(unit_copy: Path) -> None:
    shipped = UNIT.read_text().splitlines()
    copied = unit_copy.read_text().splitlines()
    assert len(shipped) == len(copied)
    changed = [(a, b) for a, b in zip(shipped, copied, strict=True) if a != b]
    assert len(changed) == 1
    (before, after) = changed[0]
    assert before.startswith(f"ExecStart={INSTALLED_BINARY} ")
    assert after == before.replace(INSTALLED_BINARY, str(CHECKOUT_BINARY))


def test_systemd_analyze_verify_passes(unit_copy: Path) -> None:
    result = subprocess.run([systemd_analyze(), "verify", str(unit_copy)], capture_output=True, text=True,
                            timeout=120)
    output = (result.stdout + result.stderr).splitlines()
    about_unit = [line for line in output if unit_copy.name in line or str(unit_copy) in line]
    assert result.returncode == 0, "\n".join(output)
    assert about_unit == [], "\n".join(about_unit)


def test_systemd_analyze_security_scores_the_sandbox_at_most_4(unit_copy: Path) -> None:
    result = subprocess.run([systemd_analyze(), "security", "--offline=true", "--no-pager", str(unit_copy)],
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    found = re.search(r"Overall exposure level for \S+: ([0-9]+(?:\.[0-9]+)?)", output)
    assert found is not None, output
    exposure = float(found.group(1))
    assert exposure <= MAX_EXPOSURE, output


def unit_settings() -> dict[str, list[str]]:
    """The shipped unit's settings: each key's values, in order (comments left out)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings.setdefault(key, []).append(value)
    return settings


def test_the_unit_names_no_group_a_box_may_lack() -> None:
    """A supplementary group the box does not have fails the start (216/GROUP: Debian 12 has no ``render`` group
    until a package makes it), and ``systemd-analyze verify`` does not see it: the unit names none. It runs as the
    user and group the README's ``useradd --user-group`` makes; device groups come from the group database
    (systemd's initgroups for User=), where ``usermod -aG`` puts them."""
    settings = unit_settings()
    assert "SupplementaryGroups" not in settings
    assert settings["User"] == ["appliance"] and settings["Group"] == ["appliance"]
    readme = (REPO / "README.md").read_text()
    assert "useradd --system --user-group --home-dir /var/lib/appliance" in readme
    assert "--groups" not in readme and "usermod -aG video appliance" in readme


def test_the_unit_passes_systemds_folders_to_the_appliance() -> None:
    """Type=notify with reload and watchdog; ExecStart gives the state and runtime folders; the stop timeout
    leaves room for the default graceful-stop grace (10 s)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings.setdefault(key, []).append(value)
    assert settings["Type"] == ["notify"]
    assert settings["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert settings["Restart"] == ["on-failure"]
    (exec_start,) = settings["ExecStart"]
    assert exec_start == (f"{INSTALLED_BINARY} run --config /etc/appliance/appliance.yaml "
                          "--data-dir ${STATE_DIRECTORY} --socket ${RUNTIME_DIRECTORY}/appliance.sock")
    assert float(settings["TimeoutStopSec"][0]) > 10
    assert float(settings["WatchdogSec"][0]) > 0


# --- the installed layout, as a real process ----------------------------------------------------------------


@pytest.fixture
def layout() -> Iterator[Path]:
    """A short temporary folder (a socket path must fit in 107 bytes) with etc/ (read-only), state/, run/."""
    base = Path(tempfile.mkdtemp(prefix="aps-"))
    for name in ("etc", "state", "run"):
        (base / name).mkdir()
    yield base
    (base / "etc").chmod(0o755)
    shutil.rmtree(base, ignore_errors=True)


def snapshot(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under ``folder`` (the folder itself as "."): mode, size, modification time in ns."""
    entries = {".": folder.stat()}
    for path in folder.rglob("*"):
        entries[str(path.relative_to(folder))] = path.lstat()
    return {name: (st.st_mode, st.st_size, st.st_mtime_ns) for name, st in entries.items()}


def installed_config(etc: Path) -> Path:
    """The shipped appliance.yaml copied into ``etc`` with only its HTTP port line changed to 0 (any free port)."""
    text = SHIPPED_CONFIG.read_text()
    port_line = re.compile(r"^(  port: )8080\b", re.MULTILINE)
    assert len(port_line.findall(text)) == 1, "the shipped config's http.port line changed"
    config = etc / "appliance.yaml"
    config.write_text(port_line.sub(r"\g<1>0   ", text))
    etc.chmod(0o555)
    return config


def wait_for_status(process: subprocess.Popen[bytes], sock: Path, log: Path, bound_s: float) -> str:
    """The first STATUS reply from ``sock``; fails when the process exits or ``bound_s`` passes first."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the appliance exited with {process.returncode} before answering:\n{log.read_text()}")
        if sock.is_socket():
            try:
                return lineclient.request(sock, "STATUS", timeout=10)
            except (ApplianceError, OSError):
                pass
        time.sleep(0.2)
    pytest.fail(f"no STATUS reply on {sock} within {bound_s:.0f} s")


def wait_for_file(path: Path, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while not path.is_file():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {bound_s:.0f} s")
        time.sleep(0.1)


def test_the_shipped_config_runs_as_installed(layout: Path) -> None:
    """The unit's command line on a copy of the shipped config in a read-only folder: the demo models and the
    registry go to the state folder, the socket to the runtime folder, nothing into the config's folder;
    SIGTERM stops it cleanly (exit 0, socket gone)."""
    etc, state, run = layout / "etc", layout / "state", layout / "run"
    config = installed_config(etc)
    before = snapshot(etc)
    sock = run / "appliance.sock"
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("APPLIANCE_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    assert CHECKOUT_BINARY.exists(), f"{CHECKOUT_BINARY} is missing: run scripts/setup.sh"
    command = [str(CHECKOUT_BINARY), "run", "--config", str(config), "--data-dir", str(state), "--socket", str(sock)]
    log = layout / "appliance.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, cwd=state, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        reply = wait_for_status(process, sock, log, START_S)
        assert reply.startswith("OK "), reply
        assert (state / "models" / "demo.gguf").is_file()
        assert (state / "models" / "demo-wide.gguf").is_file()
        wait_for_file(registry.path(state), REGISTRY_S)  # written just after the socket is bound
        assert snapshot(etc) == before
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=STOP_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=STOP_S)
    assert process.returncode == 0, log.read_text()
    assert not sock.exists(), log.read_text()
    assert not registry.path(state).exists(), log.read_text()
    assert snapshot(etc) == before  # nothing written there: not the file's own data_dir (etc/data), not a socket

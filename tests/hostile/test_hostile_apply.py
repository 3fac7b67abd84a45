"""Crafted benchmark results: Apply wrote any non-model key a result file held (``http.host: 0.0.0.0``,
``http.api_token``, ``model_dirs: [/]``, ``max_connections: 65536``; after the live Apply a model outside the old
``model_dirs`` loaded by path). Through ``appliance benchmark --result FILE --apply --yes`` and through the admin
page's "Apply advice" POST of the fixture's real appliance (same origin, its CSRF token), each crafted file is
refused naming the key, ``appliance.yaml`` stays byte for byte, nothing reloads, and a model outside
``model_dirs`` still cannot be loaded by path. A config the process may not write is refused with the command to
run instead."""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostile_checks import HUNG_S

from appliance.benchmark import apply as apply_module
from appliance.config import filewrite

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "benchmarks" / "results" / "appliance_benchmark.json"
"""A real result of ``appliance benchmark``: what the crafted files are made from."""
TOKEN = "t" * 32


def entry(key: Any, value: Any, current: Any = None) -> dict[str, Any]:
    return {"key": key, "value": value, "current": current, "reason": "measured on this box"}


TAKEOVER = [entry("http.host", "0.0.0.0", "127.0.0.1"), entry("http.api_token", TOKEN),
            entry("model_dirs", ["/"]), entry("max_connections", 65536, 64)]
"""The issue's crafted advice: with the DNS rebinding hole, a remote takeover."""


def recorded() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(RECORDED.read_text())
    return document


def crafted(advice: Any) -> dict[str, Any]:
    """The recorded result with its advice replaced."""
    document = recorded()
    document["advice"] = advice
    return document


def advised(**values: Any) -> list[dict[str, Any]]:
    """The recorded advice with some values changed (``hot_pool_slack=1.35``), so that something would be written."""
    advice = copy.deepcopy(recorded()["advice"])
    for item in advice:
        name = (item["key"] or "").removeprefix("engine.")
        if name in values:
            item["value"] = values[name]
    return advice


CRAFTED: dict[str, tuple[Any, str, str]] = {
    # name: (advice, outcome, what the refusal says)
    "takeover": ([*advised(hot_pool_slack=1.35), *TAKEOVER], "BAD_REQUEST", "http.host: not a key the advice sets"),
    "api-token": ([entry("http.api_token", TOKEN)], "BAD_REQUEST", "http.api_token: not a key the advice sets"),
    "model-dirs": ([entry("model_dirs", ["/"])], "BAD_REQUEST", "model_dirs: not a key the advice sets"),
    "max-connections": ([entry("max_connections", 65536)], "BAD_REQUEST", "max_connections: not a key the advice"),
    "model-path": ([entry("models[].path", "/etc/shadow")], "BAD_REQUEST", "models[].path: not a key the advice"),
    "window-not-a-preset": (advised(adaptive_window_size=100000), "BAD_REQUEST",
                            "engine.adaptive_window_size: 100000 is not a value the advice gives"),
    "slack-out-of-range": (advised(hot_pool_slack=99.0), "CONFIG_INVALID", "engine.hot_pool_slack: 99.0 would make"),
    "advice-not-a-list": ({"engine.live_slots": 2}, "BAD_REQUEST", "no advice to apply"),
    "entry-not-an-object": (["engine.live_slots=2"], "BAD_REQUEST", "advice entry 1: an advice entry must be a"),
    "key-not-a-string": ([entry(5, 2)], "BAD_REQUEST", "advice entry 1: key must be a dotted config key"),
    "two-values-for-a-key": ([entry("engine.live_slots", 2, 4), entry("engine.live_slots", 3, 4)], "BAD_REQUEST",
                             "two recommendations for engine.live_slots"),
}


def post_apply(hostile, name: str) -> httpx.Response:  # type: ignore[no-untyped-def]
    """The admin page's "Apply advice" as htmx sends it: same origin, the page's CSRF token."""
    url = hostile.http
    headers = {"Origin": url, "X-CSRF-Token": hostile.app.appliance.csrf_token, "HX-Request": "true"}
    # confirm=yes: past the confirmation that a run with caveats (all of these crafted ones) asks for first
    return httpx.post(f"{url}/admin/benchmarks/result/{name}/apply", headers=headers, data={"confirm": "yes"},
                      timeout=HUNG_S)


def save_result(hostile, name: str, document: dict[str, Any]) -> Path:  # type: ignore[no-untyped-def]
    folder = hostile.app.appliance.config.data_dir / "benchmarks"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(document))
    return path


def outside_model(hostile, folder: Path) -> Path:  # type: ignore[no-untyped-def]
    """A real GGUF outside the appliance's ``model_dirs``."""
    path = folder / "outside" / "intruder.gguf"
    path.parent.mkdir()
    shutil.copyfile(hostile.model_path("demo-b"), path)
    return path


def assert_nothing_changed(hostile, before: bytes, outside: Path) -> None:  # type: ignore[no-untyped-def]
    """The file byte for byte, no reload from the benchmark, the running settings, and no model by path."""
    appliance = hostile.app.appliance
    assert hostile.app.config_file.read_bytes() == before
    assert [path.name for path in hostile.app.config_file.parent.glob(".appliance.yaml.*.tmp")] == []
    assert all(record["trigger"] != "benchmark" for record in appliance.reload_history())
    config = appliance.config
    assert config.http.host == "127.0.0.1" and config.http.api_token is None
    assert config.max_connections != 65536 and Path("/") not in config.model_dirs
    reply = hostile.app.line(f"REGISTER intruder {outside}")
    assert reply.startswith("ERR FORBIDDEN"), reply
    assert "intruder" not in hostile.app.daemon.agents
    assert all(str(outside) not in name for name in hostile.app.daemon.models), list(hostile.app.daemon.models)


@pytest.mark.hostile_config(watch=True)
def test_crafted_results_applied_from_the_admin_page_change_nothing(hostile, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    before = hostile.app.config_file.read_bytes()
    outside = outside_model(hostile, tmp_path)
    for name, (advice, outcome, refusal) in CRAFTED.items():
        save_result(hostile, f"{name}.json", crafted(advice))
        response = post_apply(hostile, f"{name}.json")
        assert response.status_code == 200, (name, response.text)
        assert response.headers["x-appliance-outcome"] == outcome, (name, response.text)
        assert refusal in response.text, (name, response.text)
        assert "Traceback" not in response.text
        assert hostile.app.config_file.read_bytes() == before, name
    assert_nothing_changed(hostile, before, outside)


def appliance_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                          timeout=HUNG_S * 2, cwd=ROOT, stdin=subprocess.DEVNULL)


CLI_CASES: dict[str, tuple[int, str]] = {
    # name: (exit code, what the refusal says); a result whose advice is not advice at all is not read (exit 2)
    "takeover": (1, "cannot apply the advice: advice entry 9: http.host: not a key the advice sets"),
    "model-dirs": (1, "cannot apply the advice: advice entry 1: model_dirs: not a key the advice sets"),
    "window-not-a-preset": (1, "cannot apply the advice: engine.adaptive_window_size: 100000 is not a value the "
                               "advice gives"),
    "two-values-for-a-key": (1, "cannot apply the advice: two recommendations for engine.live_slots"),
    "advice-not-a-list": (2, "is not a result of appliance benchmark: the advice must be a list of entries, got "
                             "dict"),
    "entry-not-an-object": (2, "is not a result of appliance benchmark: advice entry 1: an advice entry must be"),
}
"""Crafted files run through the CLI too (an interpreter start each)."""


@pytest.mark.hostile_config(watch=True)
def test_crafted_results_applied_with_the_cli_change_nothing(hostile, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = hostile.app.config_file
    before = config.read_bytes()
    outside = outside_model(hostile, tmp_path)
    for name, (code, refusal) in CLI_CASES.items():
        result = tmp_path / f"{name}.json"
        result.write_text(json.dumps(crafted(CRAFTED[name][0])))
        done = appliance_cli("benchmark", "--config", str(config), "--result", str(result), "--apply", "--yes")
        assert done.returncode == code, (name, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("appliance: ") and refusal in last, (name, last)
        assert config.read_bytes() == before, name
    assert_nothing_changed(hostile, before, outside)


# -- a config this process may not write ------------------------------------------------------------------------------


def read_only(path: Path) -> bool:
    """Make ``path`` unwritable to this process: the immutable attribute as root (where the file system has it),
    the mode 0444 otherwise. False where it cannot."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        return True
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def writable_again(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o644)


@pytest.mark.hostile_config(watch=True)
def test_apply_to_a_config_the_appliance_may_not_write_gives_the_command_to_run(hostile) -> None:  # type: ignore[no-untyped-def]
    config = hostile.app.config_file
    before = config.read_bytes()
    result = save_result(hostile, "readonly.json", crafted([entry("engine.live_slots", 2, 4)]))
    if not read_only(config):
        pytest.skip("cannot make the config read-only here (root without chattr +i)")
    try:
        response = post_apply(hostile, "readonly.json")
    finally:
        writable_again(config)
    assert response.headers["x-appliance-outcome"] == "FORBIDDEN", response.text
    text = response.text
    assert f"{config} is not writable by this process" in text and "/etc/appliance read-only" in text
    command = apply_module.root_command(result, config, hostile.socket)
    assert f"benchmark --result {result} --apply --config {config} --socket {hostile.socket}" in command
    assert command.startswith("sudo ") and command in text.replace("&#39;", "'")
    assert config.read_bytes() == before
    assert all(record["trigger"] != "benchmark" for record in hostile.app.appliance.reload_history())


@pytest.mark.hostile_config(watch=True)
def test_a_file_system_that_refuses_the_write_gives_the_command_too(hostile, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The check before writing passed; the write itself met EROFS (a read-only bind mount, as systemd's
    ProtectSystem makes /etc)."""
    config = hostile.app.config_file
    before = config.read_bytes()
    save_result(hostile, "erofs.json", crafted([entry("engine.live_slots", 2, 4)]))

    def read_only_file_system(target: Path, text: str, original: os.stat_result | None) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(filewrite, "_replace", read_only_file_system)
    response = post_apply(hostile, "erofs.json")
    assert response.headers["x-appliance-outcome"] == "FORBIDDEN", response.text
    assert f"cannot write {config}: Read-only file system" in response.text
    assert "sudo " in response.text and "benchmark --result " in response.text
    assert config.read_bytes() == before
    assert all(record["trigger"] != "benchmark" for record in hostile.app.appliance.reload_history())


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ap-ro-"))
    yield path
    path.chmod(0o755)
    shutil.rmtree(path, ignore_errors=True)


def test_the_cli_refuses_a_config_it_may_not_write(record_case, folder: Path) -> None:  # type: ignore[no-untyped-def]
    """As a user: a folder it may not write, and the message gives the sudo command. As root: a read-only bind mount
    (in a mount namespace of its own), and the message says the file system is read-only."""
    config = folder / "appliance.yaml"
    shutil.copyfile(ROOT / "appliance.yaml", config)
    result = folder / "result.json"
    result.write_text(json.dumps(crafted(advised(hot_pool_slack=1.35))))
    before = config.read_bytes()
    command = [sys.executable, "-m", "appliance", "benchmark", "--config", str(config), "--result", str(result),
               "--apply", "--yes"]
    if os.geteuid() != 0:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        done = subprocess.run(command, capture_output=True, text=True, timeout=HUNG_S * 2, cwd=ROOT)
        expected = [f"{folder} is not writable by this process",
                    f"apply it as root: {apply_module.root_command(result, config)}"]
    else:
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare for a read-only bind mount")
        script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@"'
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                               str(folder), *command], capture_output=True, text=True, timeout=HUNG_S * 2, cwd=ROOT)
        if "Read-only file system" not in done.stderr and "not writable" not in done.stderr:
            pytest.skip(f"no read-only bind mount here: {done.stderr.strip()[-300:]}")
        expected = [f"{config} is not writable by this process (a read-only file system)"]
    record_case(crashed=done.returncode < 0)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    for words in expected:
        assert words in last, last
    assert config.read_bytes() == before
    assert sorted(path.name for path in folder.iterdir()) == ["appliance.yaml", "result.json"]

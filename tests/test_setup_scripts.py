"""The two set-up levels, read from what the real scripts would run (``APPLIANCE_SETUP_DRY_RUN=1`` prints each command
and runs none) in a copy of the checkout's scripts: ``scripts/run.sh`` installs the appliance and its dependencies
only, ``scripts/test.sh`` adds the test extras and the system tools; each level is skipped once its stamp is newer
than pyproject.toml. The dependencies the lean install pulls in are walked in the installed packages' metadata."""

from __future__ import annotations

import importlib.metadata
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
TEST_TOOLS = {"pytest", "hypothesis", "ruff", "openai", "playwright", "jsonschema", "anthropic", "litellm",
              "kubernetes-validate"}
"""What only the tests use: none of it belongs on a production box."""
SYSTEM_TOOLS = ("python3", "bash", "env", "dirname", "nproc", "id", "touch", "apt-get", "sudo")
"""The commands the scripts call, linked into the PATH of a run (systemd-analyze is left out: it is "missing")."""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of what the set-up reads (its scripts and pyproject.toml), with no virtualenv: a fresh machine."""
    copy = tmp_path / "checkout"
    (copy / "scripts").mkdir(parents=True)
    (copy / ".ci").mkdir()
    for script in ("setup.sh", "run.sh", "test.sh"):
        shutil.copy2(ROOT / "scripts" / script, copy / "scripts" / script)
    shutil.copy2(ROOT / ".ci" / "run", copy / ".ci" / "run")
    shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in SYSTEM_TOOLS:
        found = shutil.which(tool)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    return copy


def plan(checkout: Path, command: str, *args: str) -> tuple[list[list[str]], str]:
    """The commands ``command`` would run (each split as the shell would), and its whole stderr."""
    env = {"PATH": str(checkout.parent / "bin"), "APPLIANCE_SETUP_DRY_RUN": "1", "HOME": str(checkout.parent)}
    result = subprocess.run([str(checkout / command), *args], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line.split(" would run: ", 1)[1]) for line in result.stderr.splitlines()
                if " would run: " in line]
    return commands, result.stderr


def pip_installs(commands: list[list[str]]) -> list[list[str]]:
    """The arguments after ``pip install`` of each pip install command."""
    installs = []
    for command in commands:
        if "pip" in command and "install" in command:
            installs.append(command[command.index("install") + 1:])
    return installs


def test_the_run_command_installs_the_appliance_alone(checkout: Path) -> None:
    commands, stderr = plan(checkout, "scripts/run.sh", "--log-level", "debug")
    installs = pip_installs(commands)
    assert installs == [["--quiet", "--upgrade", "pip", "wheel"], ["--progress-bar", "off", "-e", "."]]
    assert not any("apt-get" in command for command in commands)
    for word in ("chromium", "systemd", "[test]"):  # not installed, not even said to be missing
        assert word not in stderr, stderr
    assert "llama-cpp-python builds from source the first time" in stderr
    assert commands[-1] == [".venv/bin/appliance", "run", "--config", "appliance.yaml", "--log-level", "debug"]


def test_the_test_command_installs_the_test_extras_and_the_system_tools(checkout: Path) -> None:
    commands, stderr = plan(checkout, ".ci/run")
    installs = pip_installs(commands)
    assert installs[:2] == [["--quiet", "--upgrade", "pip", "wheel"], ["--progress-bar", "off", "-e", "."]]
    assert installs[2:] == [["--progress-bar", "off", "-e", ".[test]"]]
    # systemd-analyze is not on this PATH: the test level installs Debian's systemd (or says why it cannot).
    assert ("apt-get install -y -qq --no-install-recommends systemd" in " ".join(map(shlex.join, commands))
            or "setup: systemd is missing" in stderr), stderr
    assert commands[-1][:4] == ["ruff", "check", ".", "&&"] and commands[-1][-1] == "-q"  # .ci/run's own flag


def test_a_set_up_level_already_done_is_skipped_until_pyproject_changes(checkout: Path) -> None:
    venv = checkout / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(shutil.which("python3") or "/usr/bin/python3")
    (venv / "bin" / "activate").write_text("")
    (venv / ".appliance-installed").touch()
    later = (checkout / "pyproject.toml").stat().st_mtime + 10
    os.utime(venv / ".appliance-installed", (later, later))
    run_commands, _ = plan(checkout, "scripts/run.sh")
    assert pip_installs(run_commands) == []  # the run level is done
    test_commands, _ = plan(checkout, "scripts/test.sh")
    assert pip_installs(test_commands) == [["--progress-bar", "off", "-e", ".[test]"]]  # only the test level is not
    (venv / ".appliance-test-installed").touch()
    os.utime(venv / ".appliance-test-installed", (later, later))
    assert pip_installs(plan(checkout, "scripts/test.sh")[0]) == []
    os.utime(checkout / "pyproject.toml", (later + 10, later + 10))  # a new dependency: both levels again
    assert len(pip_installs(plan(checkout, "scripts/test.sh")[0])) == 3


def test_an_unknown_level_is_refused(checkout: Path) -> None:
    result = subprocess.run([str(checkout / "scripts" / "setup.sh"), "prod"], capture_output=True, text=True,
                            timeout=60, env={"PATH": str(checkout.parent / "bin"), "APPLIANCE_SETUP_DRY_RUN": "1"})
    assert result.returncode == 2
    assert result.stderr.strip() == "usage: scripts/setup.sh [run|test] (got 'prod')"


def dependency_closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution ``requirements`` pull in, walked through the installed packages' metadata (markers
    evaluated here; ``extras`` are the root's extras that are asked for)."""
    seen: set[str] = set()
    todo = [(Requirement(text), ("", *extras)) for text in requirements]
    while todo:
        requirement, wanted = todo.pop()
        if requirement.marker is not None and not any(requirement.marker.evaluate({"extra": extra})
                                                      for extra in wanted):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            below = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: nothing known below it
        todo += [(Requirement(text), ("", *requirement.extras)) for text in below]
    return seen


def test_the_lean_install_pulls_in_no_test_tool() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lean = dependency_closure(project["dependencies"])
    assert "llama-cpp-python" in lean and "uvicorn" in lean
    assert not lean & TEST_TOOLS, sorted(lean & TEST_TOOLS)
    with_tests = dependency_closure(project["dependencies"] + project["optional-dependencies"]["test"])
    assert with_tests >= TEST_TOOLS  # what the test command adds

"""An installed, non-editable appliance has every sub-package and finds the admin page's files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from appliance.http.assets import templates_dir, web_dir

ROOT = Path(__file__).resolve().parents[1]


def listed_packages() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return pyproject["tool"]["setuptools"]["packages"]


def test_the_package_list_matches_the_folders() -> None:
    """pyproject lists packages by hand (for the web/ and templates/ mapping): a new folder must be added."""
    found = {"appliance"}
    for init in (ROOT / "appliance").rglob("__init__.py"):
        relative = init.parent.relative_to(ROOT)
        found.add(".".join(relative.parts))
    found.update({"appliance.web", "appliance.templates"})
    assert sorted(listed_packages()) == sorted(found)


def test_assets_are_found_from_the_checkout() -> None:
    assert web_dir() == ROOT / "web"
    assert templates_dir() == ROOT / "templates"


@pytest.mark.slow
def test_a_wheel_carries_every_package_and_the_assets(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("appliance", "web", "templates"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(source)], check=True, capture_output=True)
    (wheel,) = out.glob("appliance-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in listed_packages():
        assert package.replace(".", "/") + "/__init__.py" in names
    assert "appliance/web/README.md" in names
    assert "appliance/templates/README.md" in names
    assert {"appliance/web/htmx.min.js", "appliance/web/chat.js", "appliance/templates/base.html",
            "appliance/templates/_dashboard.html"} <= set(names)  # the admin page ships whole

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("from appliance.http.assets import templates_dir, web_dir; "
             "print(web_dir()); print(templates_dir())")
    shown = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {probe}"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert shown == [str(site / "appliance" / "web"), str(site / "appliance" / "templates")]

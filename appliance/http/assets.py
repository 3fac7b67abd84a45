"""Where the admin page's files are: the top-level ``web/`` (static assets) and ``templates/`` (Jinja2).

Both install inside the package as ``appliance.web`` and ``appliance.templates`` (see ``pyproject.toml``), so a
source checkout, an editable install and a wheel all find them the same way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def folder(package: str) -> Path:
    """The folder of a data-only package (``appliance.web`` or ``appliance.templates``)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed with the appliance")
    return Path(next(iter(spec.submodule_search_locations)))


def web_dir() -> Path:
    return folder("appliance.web")


def templates_dir() -> Path:
    return folder("appliance.templates")

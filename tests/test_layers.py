"""The architecture as a test: pure modules import no IO framework, not even through another module.

A pure module decides (parses, validates, plans, accounts); the shells around it (server, http, engine
runtime, daemon core) do the IO. The check reads source files with :mod:`ast`, so it imports nothing and
follows ``appliance`` imports transitively.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "appliance"

FORBIDDEN = frozenset({"asyncio", "socket", "selectors", "llama_cpp", "pynvml", "uvicorn", "starlette"})

PURE = [
    "errors",
    "config.schema",
    "config.types",
    "config.validate",
    "config.diff",
    "protocol.events",
    "protocol.frames",
    "protocol.messages",
    "protocol.connection",
    "protocol.lines",
    "daemon.ledger",
    "daemon.policy",
    "daemon.hostkv",
    "daemon.offload",
    "daemon.requestlog",
    "daemon.accesslog",
    "client.ps",
    "daemon.admission",
    "engine.slots",
    "engine.profile",
    "engine.tuning",
    "engine.adaptive",
    "engine.plans",
    "http.admin.figures",
    "engine.chat",
    "engine.toolcalls",
    "engine.structured",
    "http.openai_schema",
    "engine.gguf_meta",
    "engine.interface",
    "engine.streamtext",
    "engine.worker",
    "engine.schedule",
    "engine.prompts",
    "engine.sampling",
    "engine.triggers",
    "supervisor.plan",
    "supervisor.record",
    "config.tune",
    "benchmark.advice",
    "benchmark.report",
    "benchmark.progress",
    "http.admin.charts",
    "protocol.identifiers",
    "protocol.paging",
    "config.secrets",
    "config.modelfiles",
    "config.roundtrip",
    "models.entry",
    "http.cors",
    "supervisor.logtail",
]


def module_file(name: str) -> Path:
    path = PACKAGE.joinpath(*name.split("."))
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py")


def imported_names(source: str) -> set[str]:
    """Every module named by an import statement in ``source`` (also those inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "appliance" or node.module.startswith("appliance."):
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def read_module(name: str) -> str:
    return module_file(name).read_text()


def forbidden_imports(name: str, read: Callable[[str], str] = read_module) -> dict[str, str]:
    """{forbidden module: the appliance module that imports it} for ``name`` and what it imports."""
    found: dict[str, str] = {}
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for imported in imported_names(read(current)):
            top = imported.split(".")[0]
            if top in FORBIDDEN:
                found.setdefault(top, current)
            elif top == "appliance":
                inner = imported.removeprefix("appliance").lstrip(".")
                if inner and module_file(inner).exists():
                    todo.append(inner)
    return found


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports_no_io(name: str) -> None:
    assert module_file(name).exists(), f"{name} is listed as pure but does not exist"
    assert forbidden_imports(name) == {}


def test_the_check_catches_an_asyncio_import() -> None:
    sources = {"protocol.frames": "import json\nfrom appliance import errors\n",
               "errors": "def f():\n    import asyncio\n"}
    assert forbidden_imports("protocol.frames", read=sources.__getitem__) == {"asyncio": "errors"}


def test_the_check_catches_a_from_import() -> None:
    sources = {"daemon.policy": "from starlette.responses import JSONResponse\n"}
    assert forbidden_imports("daemon.policy", read=sources.__getitem__) == {"starlette": "daemon.policy"}


def test_every_package_module_is_reachable() -> None:
    """No module left at the top level but the application object, the CLI and the error table."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top == ["__init__", "__main__", "app", "cli", "errors"]

"""The benchmarks page: the saved results, JSON files under ``<data_dir>/benchmarks/`` (each with its
``benchmark`` name and ``headline``, as ``benchmarks/common.py`` writes them), newest first."""

from __future__ import annotations

import asyncio
import json
import operator
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.http.admin import render

MAX_RESULTS = 200
MAX_RESULT_BYTES = 4 * 1024 * 1024
"""A larger file is listed without reading it."""


def summary(path: Path) -> dict[str, Any]:
    """One saved result: its file, time and size, and its benchmark name and headline when it has them."""
    stat = path.stat()
    row: dict[str, Any] = {"file": path.name, "at": stat.st_mtime, "bytes": stat.st_size, "benchmark": None,
                           "headline": None, "problem": None, "quick": False}
    if stat.st_size > MAX_RESULT_BYTES:
        row["problem"] = f"larger than {MAX_RESULT_BYTES} bytes: not read"
        return row
    try:
        document = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        row["problem"] = f"not readable JSON ({type(exc).__name__})"
        return row
    if isinstance(document, dict):
        row["benchmark"] = document.get("benchmark") if isinstance(document.get("benchmark"), str) else None
        row["headline"] = document.get("headline") if isinstance(document.get("headline"), str) else None
        row["quick"] = document.get("quick") is True
    return row


def saved_results(folder: Path) -> list[dict[str, Any]]:
    """The result files in ``folder``, newest first (at most :data:`MAX_RESULTS`); none when it does not exist."""
    if not folder.is_dir():
        return []
    rows = []
    for path in folder.glob("*.json"):
        try:
            if path.is_file():
                rows.append(summary(path))
        except OSError:
            continue  # removed meanwhile
    rows.sort(key=operator.itemgetter("at"), reverse=True)
    return rows[:MAX_RESULTS]


async def benchmarks(request: Request) -> Response:
    folder = request.app.state.appliance.config.data_dir / "benchmarks"
    results = await asyncio.to_thread(saved_results, folder)
    return render.page(request, "benchmarks.html", "benchmarks", folder=str(folder), results=results)


routes = [Route("/admin/benchmarks", benchmarks, methods=["GET"])]

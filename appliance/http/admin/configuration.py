"""The config page: the file as running (or a note that the file on disk is invalid and the appliance runs its last
valid config), its validation status, the reload record with each diff, and a "reload now" button. The API token is
never shown: every secret setting is taken out by :func:`appliance.config.secrets.redact`."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.config import secrets
from appliance.config.validate import MAX_CONFIG_BYTES
from appliance.errors import ApplianceError
from appliance.http.admin import render

if TYPE_CHECKING:
    from appliance.app import Appliance

def read_file(path: Path) -> tuple[str | None, str | None]:
    """The file's text (at most MAX_CONFIG_BYTES), or why it cannot be read."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    if len(data) > MAX_CONFIG_BYTES:
        return None, f"{path} is larger than {MAX_CONFIG_BYTES} bytes"
    return data.decode("utf-8", "replace"), None


async def figures_of(appliance: Appliance) -> dict[str, Any]:
    hidden = secrets.values_of(appliance.config)
    report = {key: secrets.redact(value, hidden) if isinstance(value, str) else value
              for key, value in appliance.config_report().items()}
    text, unreadable = None, None
    if appliance.config_path is not None:
        text, unreadable = await asyncio.to_thread(read_file, appliance.config_path)
    history = []
    for record in reversed(appliance.reload_history()):
        history.append({**record, "problems": [secrets.redact(p, hidden) for p in record["problems"]],
                        "error": secrets.redact(record["error"], hidden)})
    config = appliance.config
    return {"report": report, "text": None if text is None else secrets.redact(text, hidden), "unreadable": unreadable,
            "history": history, "can_reload": appliance.reloader is not None, "config": config,
            "models": config.models, "http_url": appliance.http_url}


async def configuration(request: Request) -> Response:
    appliance = request.app.state.appliance
    return render.page(request, "config.html", "config", **await figures_of(appliance))


async def configuration_partial(request: Request) -> Response:
    appliance = request.app.state.appliance
    return render.fragment("_config.html", **await figures_of(appliance))


async def reload_now(request: Request) -> Response:
    appliance = request.app.state.appliance
    try:
        if appliance.reloader is None:
            raise ApplianceError("BAD_REQUEST", "this appliance was started without a config file to reload",
                                 {"config_file": None})
        record = await appliance.reloader.reload("api")
    except ApplianceError as error:
        return render.result("Reload failed.", error)
    line = secrets.redact(record.line(), secrets.values_of(appliance.config))
    if record.result in ("invalid", "failed"):
        error = ApplianceError("CONFIG_INVALID" if record.result == "invalid" else "INTERNAL", line,
                               {"result": record.result})
        return render.result("Reload refused: the appliance keeps running its last valid config.", error)
    return render.result(line[:1].upper() + line[1:])  # "Reload (api) applied in 12 ms: ..."


routes = [
    Route("/admin/config", configuration, methods=["GET"]),
    Route("/admin/config/_status", configuration_partial, methods=["GET"]),
    Route("/admin/config/reload", reload_now, methods=["POST"]),
]

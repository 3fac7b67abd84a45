"""The device page: the current reading, and an NVML resync button (``daemon.resync`` in a thread: it re-reads the
device and re-bases the ledger cap) that shows the reading before and after."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.errors import ApplianceError
from appliance.http.admin import render

if TYPE_CHECKING:
    from appliance.daemon.core import Daemon


def reading_of(daemon: Daemon) -> dict[str, Any]:
    """The device as the daemon last read it, with the cap it gave the ledger."""
    reading = daemon.reading
    return {"name": reading.name, "kind": reading.kind, "total": reading.total, "used": reading.used,
            "free": reading.free, "process_used": reading.process_used, "external": daemon.external,
            "cap": daemon.ledger.cap, "allocated": daemon.ledger.allocated}


ROWS = (("total", "Total"), ("used", "Used"), ("free", "Free"), ("process_used", "This process"),
        ("external", "Other processes"), ("cap", "Ledger cap"), ("allocated", "Ledger allocated"))
"""The figures of a reading the page shows, in order."""


async def device(request: Request) -> Response:
    daemon = render.daemon_of(request)
    return render.page(request, "device.html", "device", reading=reading_of(daemon), rows=ROWS,
                       interval_s=daemon.config.resync_interval_s)


async def resync(request: Request) -> Response:
    try:
        daemon = render.daemon_of(request)
        before = reading_of(daemon)
        await asyncio.to_thread(daemon.resync)
        after = reading_of(daemon)
    except ApplianceError as error:
        return render.result("Resync failed.", error)
    return render.fragment("_resync.html", before=before, after=after, rows=ROWS,
                           headers={render.OUTCOME_HEADER: "ok"})


routes = [
    Route("/admin/device", device, methods=["GET"]),
    Route("/admin/device/resync", resync, methods=["POST"]),
]

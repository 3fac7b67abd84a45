"""Start a real appliance (real socket, real HTTP server, real models) in a background thread for tests."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from appliance.client import lines as lineclient
from appliance.app import Appliance
from appliance.config.validate import parse_config


def config_text(models: dict[str, dict[str, Any]], *, state: Path, model_dirs: list[Path],
                device: str = "fake:8GiB", **extra: Any) -> str:
    doc: dict[str, Any] = {
        "data_dir": str(state),
        "device": device,
        "model_dirs": [str(d) for d in model_dirs],
        "socket": {"path": str(state / "a.sock")},
        "http": {"host": "127.0.0.1", "port": 0},
        "resync_interval_s": 0,
        "models": [{"name": name, **spec} for name, spec in models.items()],
    }
    doc.update(extra)
    return yaml.safe_dump(doc, sort_keys=False)


class Running:
    def __init__(self, appliance: Appliance, loop: asyncio.AbstractEventLoop) -> None:
        self.appliance = appliance
        self.loop = loop

    @property
    def socket(self) -> Path:
        return self.appliance.config.socket.path

    @property
    def daemon(self):  # type: ignore[no-untyped-def]
        return self.appliance.daemon

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def line(self, text: str, timeout: float = 120) -> str:
        return lineclient.request(self.socket, text, timeout)


@contextmanager
def running(models: dict[str, dict[str, Any]], *, model_dirs: list[Path], http: bool = True,
            **extra: Any) -> Iterator[Running]:
    """A real appliance on a short temporary socket path (AF_UNIX paths are limited to 108 bytes)."""
    state = Path(tempfile.mkdtemp(prefix="ap-"))
    try:
        text = config_text(models, state=state, model_dirs=model_dirs, **extra)
        config = parse_config(text, source=state / "appliance.yaml", base_dir=state)
        appliance = Appliance(config, http=http)
        loop = asyncio.new_event_loop()
        started = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(loop)

            async def boot() -> None:
                try:
                    await appliance.start()
                except BaseException as exc:
                    failure.append(exc)
                finally:
                    started.set()

            loop.run_until_complete(boot())
            loop.run_forever()

        thread = threading.Thread(target=main, name="appliance", daemon=True)
        thread.start()
        started.wait(120)
        if failure:
            raise failure[0]
        run = Running(appliance, loop)
        try:
            yield run
        finally:
            run.call(appliance.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
    finally:
        shutil.rmtree(state, ignore_errors=True)

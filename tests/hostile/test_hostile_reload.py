"""Reloads the careless way: a config written in place a byte at a time or truncated then written, an empty file
on every trigger, a model registered by path whose file is replaced, SIGTERM while a request waits for its model
to load; and what must hold already: a burst of edits, a stream across a reload, SIGTERM during a reload.

The appliance watches its config (``hostile_config(watch=True)``: :meth:`harness.Running.edit` saves it the way
editors do); a :class:`RegisterProbe` registers fresh agents on both models all along, so a reload that retired a
model for a moment shows as an ``UNKNOWN_MODEL`` it was answered.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness import RawPeer, Running, running
from hostile_checks import HUNG_S, request

from appliance.config.validate import Config
from appliance.engine.fake import GatedEngine
from appliance.engine.tinymodel import write_tiny_model
from appliance.protocol import messages as m

SLOW_WRITE_S = 2.0


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


class RegisterProbe:
    """A line client that registers and unregisters a fresh agent on each model in turn, all along; every refusal
    is kept (a model missing from the running config for a moment is ``UNKNOWN_MODEL``)."""

    def __init__(self, socket_path: Path, models: tuple[str, ...]) -> None:
        self.socket_path = socket_path
        self.models = models
        self.registered = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="register-probe", daemon=True)

    def run(self) -> None:
        count = 0
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(HUNG_S)
            sock.connect(str(self.socket_path))
            reader = sock.makefile("rb")
            while not self.stop.is_set():
                count += 1
                agent = f"probe-{count}"
                reply = request(sock, reader, f"REGISTER {agent} {self.models[count % len(self.models)]}")
                if reply.startswith("ERR"):
                    self.errors.append(reply.strip())
                else:
                    self.registered += 1
                    request(sock, reader, f"UNREGISTER {agent}")
                self.stop.wait(0.03)

    def __enter__(self) -> RegisterProbe:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(HUNG_S)


def records(app: Running) -> list[dict[str, Any]]:
    return app.appliance.reload_history()


def with_setting(text: str, key: str, value: Any, *, first: bool = True) -> str:
    """``text`` (the harness's YAML) with ``key: value`` added as its first key (the models, last, come after it)
    or as its last."""
    line = yaml.safe_dump({key: value}, sort_keys=False)
    return line + text if first else text + line


def write_slowly(path: Path, text: str, seconds: float) -> None:
    """Truncate ``path`` and write ``text`` into it in place, a byte at a time (each flushed), over ``seconds``."""
    data = text.encode()
    with open(path, "wb") as fh:
        for index in range(len(data)):
            fh.write(data[index:index + 1])
            fh.flush()
            time.sleep(seconds / len(data))


def assert_nothing_moved_or_retired(app: Running, url: str, sock: Path) -> None:
    for record in records(app):
        assert "removed models" not in record["diff"] and "rebinding" not in record["applied"], record
    assert app.appliance.http_url == url
    assert app.socket == sock
    assert [spec.name for spec in app.appliance.config.models] == ["demo", "demo-b"]


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/health", timeout=HUNG_S).json()


# -- half-written files --------------------------------------------------------------------------------------------
@pytest.mark.hostile_config(watch=True)
def test_a_config_written_in_place_a_byte_at_a_time_is_applied_only_whole(hostile) -> None:  # type: ignore[no-untyped-def]
    app = hostile.app
    url, sock = app.appliance.http_url, app.socket
    wanted = with_setting(app.config_file.read_text(), "admission_percent", 80)  # models come last: read half-way,
    with RegisterProbe(app.socket, ("demo", "demo-b")) as probe:                  # the file has none
        write_slowly(app.config_file, wanted, SLOW_WRITE_S)
        wait_for(lambda: app.appliance.config.admission_percent == 80, 30, "the whole file applied")
        app.call(app.appliance.reloader.settled(), 30)
    assert not probe.errors, probe.errors[:3]
    assert probe.registered > 0
    assert not hostile.neighbour.errors, hostile.neighbour.errors[:3]
    assert_nothing_moved_or_retired(app, url, sock)
    assert records(app)[-1]["result"] == "applied"


@pytest.mark.hostile_config(watch=True)
def test_a_config_truncated_then_written_is_applied_only_once_written(hostile) -> None:  # type: ignore[no-untyped-def]
    app = hostile.app
    url, sock = app.appliance.http_url, app.socket
    wanted = with_setting(app.config_file.read_text(), "admission_percent", 75, first=False)
    with RegisterProbe(app.socket, ("demo", "demo-b")) as probe:
        with open(app.config_file, "wb") as fh:  # `cat > appliance.yaml`: empty first, then written
            fh.flush()
            time.sleep(0.5)  # the watchers see the empty file
            fh.write(wanted.encode())
        wait_for(lambda: app.appliance.config.admission_percent == 75, 30, "the written file applied")
        app.call(app.appliance.reloader.settled(), 30)
    assert not probe.errors, probe.errors[:3]
    assert not hostile.neighbour.errors, hostile.neighbour.errors[:3]
    assert_nothing_moved_or_retired(app, url, sock)
    assert health(url)["status"] == "ok"


def trigger_reload(app: Running, how: str) -> None:
    """Ask the running appliance for a reload the way ``how`` says (the file itself was just saved)."""
    if how == "SIGHUP":
        app.loop.call_soon_threadsafe(app.appliance._on_reload_signal)
    elif how == "RELOAD":
        assert app.line("RELOAD", timeout=HUNG_S).startswith("OK")
    elif how == "TUNE":
        assert app.line("TUNE engine.adaptive_sample_rate=8", timeout=HUNG_S).startswith("OK")
    elif how == "admin":
        url = app.appliance.http_url or ""
        headers = {"Origin": url, "X-CSRF-Token": app.appliance.csrf_token, "HX-Request": "true"}
        assert httpx.post(f"{url}/admin/config/reload", headers=headers, timeout=HUNG_S).status_code == 200
    elif how != "file":
        raise AssertionError(how)


def next_record(app: Running, seen: int, trigger: str, timeout: float = 30) -> dict[str, Any]:
    """The first reload recorded with ``trigger`` after the first ``seen`` records."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in records(app)[seen:]:
            if record["trigger"] == trigger:
                return record
        time.sleep(0.02)
    raise AssertionError(f"no {trigger} reload recorded within {timeout} s: {records(app)[seen:]}")


TRIGGER_RECORDED = {"file": "file", "SIGHUP": "SIGHUP", "RELOAD": "api", "TUNE": "tune", "admin": "api"}


@pytest.mark.hostile_config(watch=True)
@pytest.mark.parametrize("content", ["", "\n# nothing yet\n"], ids=["empty", "comment-only"])
def test_an_empty_config_is_refused_on_every_trigger(hostile, content: str) -> None:  # type: ignore[no-untyped-def]
    app = hostile.app
    url, sock = app.appliance.http_url or "", app.socket
    good = app.config_file.read_text()
    with RegisterProbe(app.socket, ("demo", "demo-b")) as probe:
        app.edit(content)
        for how in ("file", "SIGHUP", "RELOAD", "TUNE", "admin"):
            seen = len(records(app))
            trigger_reload(app, how)
            record = next_record(app, seen, TRIGGER_RECORDED[how])
            assert record["result"] == "invalid" and "no settings" in record["problems"][0], (how, record)
            doc = health(url)
            assert doc["status"] == "degraded" and "no settings" in doc["reason"], (how, doc)
            assert "status=invalid" in app.line("STATUS", timeout=HUNG_S)
        app.edit(good)
        wait_for(lambda: health(url)["status"] == "ok", 30, "health ok once the file is back")
    assert not probe.errors, probe.errors[:3]
    assert not hostile.neighbour.errors, hostile.neighbour.errors[:3]
    assert_nothing_moved_or_retired(app, url, sock)
    assert app.appliance.config.http.port != 8080


# -- a model registered by path ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with demo-b's shape and other weights, written before any case's appliance starts."""
    path = tmp_path_factory.mktemp("other-weights") / "other.gguf"
    write_tiny_model(path, layers=2, dim=128, seed=11)
    return path


@pytest.mark.hostile_config(watch=True)
def test_a_model_registered_by_path_whose_file_is_replaced_does_not_block_reloads(other_weights: Path,
                                                                                hostile) -> None:  # type: ignore[no-untyped-def]
    app = hostile.app
    daemon = app.daemon
    path = hostile.model_dir / "by-path.gguf"
    shutil.copyfile(hostile.model_path("demo-b"), path)
    assert app.line(f"REGISTER p {path}", timeout=HUNG_S).startswith("OK")
    assert app.line("DECODE p 3 Hello", timeout=HUNG_S).startswith("OK")
    key = str(path.resolve())
    runtime = daemon.models[key].runtime
    fresh = path.with_name(".by-path.gguf.new")
    shutil.copyfile(other_weights, fresh)
    os.replace(fresh, path)  # the same path, new weights; no config names this model
    record = app.reload("SIGHUP")
    assert record.result == "applied" and f"{key} reloaded" in record.applied, record
    assert daemon.models[key].runtime is not runtime
    app.edit(with_setting(app.config_file.read_text(), "admission_percent", 85))
    wait_for(lambda: app.appliance.config.admission_percent == 85, 30, "an unrelated edit applied")
    assert records(app)[-1]["result"] == "applied", records(app)[-1]
    assert app.line("DECODE p 3", timeout=HUNG_S).startswith("OK")
    assert app.line("UNREGISTER p", timeout=HUNG_S).startswith("OK")
    assert not hostile.neighbour.errors, hostile.neighbour.errors[:3]


# -- SIGTERM while a request waits for its model's load ------------------------------------------------------------
class HeldLoadEngine(GatedEngine):
    """The real engine whose model loads wait for :attr:`loads` (its trial check blocks, off the event loop)."""

    def __init__(self, config: Config) -> None:
        from appliance.engine.runtime import Engine

        super().__init__(Engine(config.engine.threads or None))
        self.loads = threading.Event()

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        self.loads.wait(HUNG_S)
        super().check(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)


@contextmanager
def held_load(tiny_model: Path, grace_s: float) -> Iterator[Running]:
    models = {"demo": {"path": str(tiny_model)}}
    with running(models, model_dirs=[tiny_model.parent], engine_factory=HeldLoadEngine,
                 shutdown_grace_s=grace_s) as app:
        yield app


def http_completion(app: Running, out: dict[str, Any]) -> None:
    body = {"model": "demo", "prompt": "Hello", "max_tokens": 6, "temperature": 0}
    response = httpx.post(f"{app.appliance.http_url}/v1/completions", json=body, timeout=HUNG_S * 2)
    out["status"] = response.status_code
    out["body"] = response.json()


def http_agent_chat(app: Running, out: dict[str, Any]) -> None:
    """An OpenAI chat with ``user``: one request that registers its agent (loading the model), then decodes."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0,
            "user": "agent-in-grace"}
    response = httpx.post(f"{app.appliance.http_url}/v1/chat/completions", json=body, timeout=HUNG_S * 2)
    out["status"] = response.status_code
    out["body"] = response.json()


CLIENTS = {"http": http_completion, "http-agent": http_agent_chat}


def magn_completion(app: Running, out: dict[str, Any]) -> None:
    peer = RawPeer(app.socket, timeout=HUNG_S * 2)
    try:
        peer.send({"type": "INFER_REQUEST", "task_id": "t", "model": "demo", "prompt": "Hello", "max_tokens": 6,
                   "temperature": 0})
        out["end"] = peer.read_until_end("t")[-1]
    finally:
        peer.close()


def served(surface: str, out: dict[str, Any]) -> bool:
    if surface.startswith("http"):
        return out["status"] == 200 and out["body"]["usage"]["completion_tokens"] == 6
    end = out["end"]
    return isinstance(end, m.TaskComplete) and end.usage.completion_tokens == 6


def refused_shutting_down(surface: str, out: dict[str, Any]) -> bool:
    if surface == "http":
        return out["status"] == 503 and out["body"]["error"]["code"] == "SHUTTING_DOWN"
    end = out["end"]
    return isinstance(end, m.ErrorMessage) and end.error.code == "SHUTTING_DOWN"


def stop_in_background(app: Running) -> threading.Thread:
    thread = threading.Thread(target=app.call, args=(app.appliance.stop(),), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("surface", ["http", "http-agent", "magn"])
def test_sigterm_while_a_request_waits_for_its_model_load_gives_it_the_grace(record_case, tiny_model: Path,
                                                                            surface: str) -> None:
    row = record_case(hung=True)
    with held_load(tiny_model, grace_s=30) as app:
        out: dict[str, Any] = {}
        client = threading.Thread(target=CLIENTS.get(surface, magn_completion), args=(app, out))
        client.start()
        wait_for(lambda: app.daemon.model_state("demo") == "loading", HUNG_S, "the model loading")
        stopper = stop_in_background(app)
        wait_for(lambda: app.daemon.closing, HUNG_S, "the stop begun")
        time.sleep(0.3)  # the stop is draining: the request, still waiting for the load, is not refused meanwhile
        assert client.is_alive(), f"answered before its model loaded: {out}"
        app.engine.loads.set()
        client.join(HUNG_S)
        stopper.join(HUNG_S)
        row.hung = client.is_alive() or stopper.is_alive()
        assert not row.hung
        assert served(surface, out), out
        assert not app.socket.exists()


def test_sigterm_while_a_load_outlasts_the_grace_ends_it_with_shutting_down(record_case, tiny_model: Path) -> None:
    row = record_case(hung=True)
    with held_load(tiny_model, grace_s=0.5) as app:
        out: dict[str, Any] = {}
        client = threading.Thread(target=http_completion, args=(app, out))
        client.start()
        wait_for(lambda: app.daemon.model_state("demo") == "loading", HUNG_S, "the model loading")
        stopper = stop_in_background(app)
        wait_for(lambda: app.daemon.grace_over, HUNG_S, "the grace period over")
        app.engine.loads.set()
        client.join(HUNG_S)
        stopper.join(HUNG_S)
        row.hung = client.is_alive() or stopper.is_alive()
        assert not row.hung
        assert refused_shutting_down("http", out), out


# -- what holds already ----------------------------------------------------------------------------------------------
@pytest.mark.hostile_config(watch=True)
def test_a_storm_of_fifty_edits_is_one_or_few_reloads_and_loses_nothing(hostile) -> None:  # type: ignore[no-untyped-def]
    app = hostile.app
    url, sock = app.appliance.http_url, app.socket
    good = app.config_file.read_text()
    assert app.line("REGISTER kept demo-b", timeout=HUNG_S).startswith("OK")
    with RegisterProbe(app.socket, ("demo", "demo-b")) as probe:
        for percent in range(50, 100):
            app.edit(with_setting(good, "admission_percent", percent))
        wait_for(lambda: app.appliance.config.admission_percent == 99, 30, "the last edit applied")
        app.call(app.appliance.reloader.settled(), 30)
    assert len(records(app)) <= 10, [r["diff"] for r in records(app)]
    assert not probe.errors, probe.errors[:3]
    assert not hostile.neighbour.errors, hostile.neighbour.errors[:3]
    assert "kept" in app.daemon.agents
    assert app.line("DECODE kept 2 Hello", timeout=HUNG_S).startswith("OK")
    assert_nothing_moved_or_retired(app, url, sock)


@pytest.mark.hostile_config(watch=True)
def test_a_stream_goes_on_across_an_unrelated_reload(hostile) -> None:  # type: ignore[no-untyped-def]
    app = hostile.app
    app.engine.delay_s = 0.03
    body = {"model": "demo-b", "prompt": "Hello", "max_tokens": 40, "temperature": 0, "stream": True}
    tokens = 0
    finish = None
    try:
        with httpx.stream("POST", f"{app.appliance.http_url}/v1/completions", json=body, timeout=HUNG_S) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                choice = event["choices"][0] if event["choices"] else {}
                tokens += bool(choice.get("text"))
                finish = choice.get("finish_reason") or finish
                if tokens == 5:
                    app.edit(with_setting(app.config_file.read_text(), "admission_percent", 70))
                    wait_for(lambda: app.appliance.config.admission_percent == 70, 30, "the reload applied")
    finally:
        app.engine.delay_s = 0.0
    assert finish == "length"
    assert records(app)[-1]["result"] == "applied"
    assert not hostile.neighbour.errors, hostile.neighbour.errors[:3]


def test_sigterm_during_a_reload_stops_without_applying_it(record_case, tiny_model: Path,
                                                           tiny_model_b: Path) -> None:
    row = record_case(hung=True)
    models = {"demo": {"path": str(tiny_model)}, "demo-b": {"path": str(tiny_model_b)}}
    with running(models, model_dirs=[tiny_model.parent], watch=True) as app:
        reloader = app.appliance.reloader
        assert reloader is not None
        good = app.config_file.read_text()
        app.edit(good.split("models:")[0] + "models: []\n")  # retires every model: waits for the file to settle
        out: dict[str, str] = {}

        def ask() -> None:
            try:
                out["reply"] = app.line("RELOAD", timeout=HUNG_S)
            except (OSError, ConnectionError) as exc:  # the stop may close the connection before it answers
                out["reply"] = f"closed: {exc}"

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: reloader._lock.locked(), HUNG_S, "a reload under way")
        started = time.monotonic()
        stopper = stop_in_background(app)
        stopper.join(HUNG_S)
        asker.join(HUNG_S)
        row.hung = stopper.is_alive() or asker.is_alive()
        assert not row.hung
        assert time.monotonic() - started < 10
        assert [spec.name for spec in app.appliance.config.models] == ["demo", "demo-b"]
        assert all(r["result"] != "applied" for r in records(app)), records(app)
        assert not app.socket.exists()

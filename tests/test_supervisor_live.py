"""Hot reload, systemd notify and graceful stop on a running appliance (SPEC C3, S1, S2): real socket, real HTTP,
real tiny models; the config file is edited the way editors save it (write a sibling, rename it over)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RawPeer, Running, config_text, running

from appliance.client.lines import header_fields, read_reply, response_body
from appliance.daemon import registry
from appliance.engine.tinymodel import write_tiny_model
from appliance.protocol import messages as m
from appliance.supervisor.notify import Notifier


def rewrite(app: Running, models: dict[str, dict[str, Any]], model_dir: Path, **extra: Any) -> None:
    """Save a new config for ``app`` (same state folder and socket unless ``extra`` says otherwise)."""
    state = app.appliance.config.data_dir
    app.edit(config_text(models, state=state, model_dirs=[model_dir], **extra))


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; return the seconds it took (AssertionError after ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def reloads(app: Running) -> list[dict[str, Any]]:
    return app.appliance.reload_history()


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/v1/health", timeout=10) as response:
        return json.loads(response.read())


class LineSession:
    """One line-protocol connection kept open across requests."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(str(path))
        self.stream = self.sock.makefile("r", encoding="utf-8", newline="\n")

    def send(self, line: str) -> None:
        self.sock.sendall(line.encode() + b"\n")

    def ask(self, line: str) -> str:
        self.send(line)
        return read_reply(self.stream)

    def close(self) -> None:
        self.stream.close()
        self.sock.close()


def decode_text(reply: str) -> str:
    assert reply.startswith("OK"), reply
    return response_body(reply)


# -- hot reload ---------------------------------------------------------------------------------------------
def test_an_atomic_edit_adding_a_model_makes_it_registrable_within_2_s(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        assert app.line("REGISTER a demo").startswith("OK")
        rewrite(app, {**demo, "extra": {"path": str(model_dir / "tiny_b.gguf")}}, model_dir)
        took = wait_for(lambda: "name=extra" in app.line("LIST"), 10, "the added model listed")
        assert took < 2.0, f"the edit took {took:.2f} s to apply"
        assert app.line("REGISTER b extra").startswith("OK")
        record = reloads(app)[-1]
        assert (record["trigger"], record["result"]) == ("file", "applied")
        assert "added models: extra" in record["diff"]
        assert len(reloads(app)) == 1  # two watchers, one edit: one reload
        assert decode_text(app.line("DECODE a 4 Hello"))  # the agent on the untouched model still decodes


def test_a_broken_file_degrades_health_and_status_until_it_is_fixed(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        url = app.appliance.http_url
        assert app.line("REGISTER a demo").startswith("OK")
        good = app.config_file.read_text()
        broken = good.replace("models:\n", f"models:\n- name: bad\n  path: {model_dir / 'tiny.gguf'}\n  n_ctx: lots\n")
        assert broken != good
        app.edit(broken)
        wait_for(lambda: health(url)["status"] == "degraded", 10, "health degraded")
        doc = health(url)
        line = broken.splitlines().index("  n_ctx: lots") + 1
        assert doc["line"] == line and "n_ctx" in doc["reason"], doc
        assert doc["config"]["status"] == "invalid"
        status = app.line("STATUS")
        config_line = next(text for text in status.splitlines() if text.startswith("config "))
        assert "status=invalid" in config_line and f"line={line}" in config_line
        assert "result=invalid" in status
        assert decode_text(app.line("DECODE a 4 Hello"))  # everything still serves on the last valid config
        assert [m.name for m in app.appliance.config.models] == ["demo"]
        app.edit(good + "# fixed\n")
        wait_for(lambda: health(url)["status"] == "ok", 10, "health ok again")
        assert reloads(app)[-1]["result"] == "unchanged"  # a comment: nothing to apply
        assert "status=ok" in app.line("STATUS")


def test_lowering_admission_keeps_every_model_and_agent_and_shows_over_cap(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True, device="fake:1GiB") as app:
        daemon = app.daemon
        assert app.line("REGISTER a demo").startswith("OK")
        first = decode_text(app.line("DECODE a 8 Once upon a time"))
        runtime = daemon.models["demo"].runtime
        rebuilds = daemon.counters["host_kv_rebuilds"]
        rewrite(app, demo, model_dir, device="fake:1GiB", admission_percent=1)
        wait_for(lambda: daemon.ledger.cap < daemon.ledger.allocated, 10, "the lower cap applied")
        assert daemon.snapshot()["ledger"]["over_cap"] is True
        assert "over_cap=yes" in app.line("STATUS") or "over_cap=true" in app.line("STATUS")
        # Nothing was evicted: the same runtime, the agent's KV where it was.
        assert daemon.models["demo"].runtime is runtime and "a" in daemon.agents
        second = decode_text(app.line("DECODE a 8 and then"))
        assert daemon.counters["host_kv_rebuilds"] == rebuilds
        # The uninterrupted conversation, on a second agent: the same greedy text.
        assert app.line("REGISTER b demo").startswith("OK")
        assert decode_text(app.line("DECODE b 8 Once upon a time")) == first
        assert decode_text(app.line("DECODE b 8 and then")) == second
        # A new model is refused while over the cap.
        rewrite(app, {**demo, "other": {"path": str(model_dir / "tiny_b.gguf")}}, model_dir, device="fake:1GiB",
                admission_percent=1)
        wait_for(lambda: daemon.config.model("other") is not None, 10, "the model added")
        refused = app.line("REGISTER c other")
        assert refused.startswith("ERR VRAM_LEDGER_DENY"), refused


def test_moving_the_http_port_keeps_a_socket_conversation_going(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        old_url = app.appliance.http_url
        session = LineSession(app.socket)
        try:
            assert session.ask("REGISTER a demo").startswith("OK")
            assert decode_text(session.ask("DECODE a 4 Hello"))
            tokens = len(app.daemon.agents["a"].conversation.tokens)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            rewrite(app, demo, model_dir, http={"host": "127.0.0.1", "port": port})
            wait_for(lambda: app.appliance.http_url == f"http://127.0.0.1:{port}", 10, "HTTP moved")
            assert health(f"http://127.0.0.1:{port}")["status"] == "ok"
            wait_for(lambda: refused(old_url), 10, "the old port closed")
            reply = session.ask("DECODE a 4")  # the same connection, the same conversation
            assert decode_text(reply)
            assert len(app.daemon.agents["a"].conversation.tokens) == tokens + 4
            document = json.loads(registry.path(app.appliance.config.data_dir).read_text())
            assert document["http"] == f"http://127.0.0.1:{port}"
        finally:
            session.close()


def refused(url: str) -> bool:
    try:
        health(url)
    except (urllib.error.URLError, ConnectionError, OSError):
        return True
    return False


def test_moving_the_socket_serves_the_new_path_and_finishes_connections_on_the_old(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        old_path = app.socket
        session = LineSession(old_path)
        try:
            assert session.ask("REGISTER a demo").startswith("OK")
            new_path = old_path.with_name("b.sock")
            rewrite(app, demo, model_dir, socket={"path": str(new_path)})
            wait_for(lambda: len(reloads(app)) == 1, 10, "the reload recorded")
            assert app.socket == new_path
            assert not old_path.exists() and new_path.is_socket()
            assert app.line("LIST").startswith("OK")  # through the new path
            assert decode_text(session.ask("DECODE a 4 Hello"))  # the old connection goes on
            assert old_path.with_name("a.sock.lock").read_text() == ""  # released (the file stays)
            assert new_path.with_name("b.sock.lock").read_text().strip() == str(os.getpid())
        finally:
            session.close()


def test_a_changed_model_file_reloads_that_model_only(model_dir: Path, tmp_path: Path) -> None:
    models = {"demo": {"path": str(model_dir / "tiny.gguf")}, "other": {"path": str(model_dir / "tiny_b.gguf")}}
    with running(models, model_dirs=[model_dir], watch=True) as app:
        daemon = app.daemon
        for agent, model in (("a", "demo"), ("b", "other")):
            assert app.line(f"REGISTER {agent} {model}").startswith("OK")
            assert decode_text(app.line(f"DECODE {agent} 6 Hello there"))
        other_runtime = daemon.models["other"].runtime
        other_conv = daemon.agents["b"].conversation
        other_state = (list(other_conv.tokens), other_conv.where, other_conv.n_evaluated,
                       None if other_conv.buffer is None else bytes(other_conv.buffer))
        demo_runtime = daemon.models["demo"].runtime
        tokens_before = len(daemon.agents["a"].conversation.tokens)
        retrained = model_dir / "tiny_v2.gguf"
        write_tiny_model(retrained, layers=4, dim=256, seed=7)  # other weights, the same vocabulary
        rewrite(app, {**models, "demo": {"path": str(retrained)}}, model_dir)
        wait_for(lambda: len(reloads(app)) == 1, 30, "the reload recorded")
        assert daemon.models["demo"].runtime is not demo_runtime
        record = reloads(app)[-1]
        assert record["result"] == "applied" and "demo" in record["applied"], record
        assert daemon.models["demo"].spec.path == retrained
        assert daemon.models["other"].runtime is other_runtime  # untouched, byte for byte
        conv = daemon.agents["b"].conversation
        assert (list(conv.tokens), conv.where, conv.n_evaluated,
                None if conv.buffer is None else bytes(conv.buffer)) == other_state
        reply = app.line("DECODE a 4")  # the conversation goes on, re-evaluated on the new weights
        assert decode_text(reply)
        assert len(daemon.agents["a"].conversation.tokens) >= tokens_before + 4


def test_a_model_file_replaced_in_place_is_reloaded_on_sighup(model_dir: Path) -> None:
    models = {"demo": {"path": str(model_dir / "tiny.gguf")}, "other": {"path": str(model_dir / "tiny_b.gguf")}}
    with running(models, model_dirs=[model_dir], watch=True) as app:
        daemon = app.daemon
        for agent, model in (("a", "demo"), ("b", "other")):
            assert app.line(f"REGISTER {agent} {model}").startswith("OK")
            assert decode_text(app.line(f"DECODE {agent} 4 Hello"))
        runtimes = {name: daemon.models[name].runtime for name in models}
        assert app.reload("SIGHUP").result == "unchanged"  # nothing changed yet
        fresh = model_dir / ".tiny.gguf.new"
        write_tiny_model(fresh, layers=4, dim=256, seed=9)
        os.replace(fresh, model_dir / "tiny.gguf")  # the same path, new weights; appliance.yaml untouched
        record = app.reload("SIGHUP")
        assert record.result == "applied" and "demo reloaded" in record.applied, record
        assert daemon.models["demo"].runtime is not runtimes["demo"]
        assert daemon.models["other"].runtime is runtimes["other"]
        assert decode_text(app.line("DECODE a 4"))
        assert app.reload("SIGHUP").result == "unchanged"  # loaded from the new file: nothing more to do


def test_a_model_file_that_fails_its_check_keeps_the_old_model_serving(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        daemon = app.daemon
        assert app.line("REGISTER a demo").startswith("OK")
        first = decode_text(app.line("DECODE a 4 Hello"))
        app.settle()  # a retune that request asked for holds a context beside the live one meanwhile
        runtime = daemon.models["demo"].runtime
        allocated = daemon.ledger.allocated
        broken = model_dir / "broken.gguf"
        broken.write_bytes(b"GGUF" + bytes(60))  # the magic, then nothing that makes a model
        rewrite(app, {"demo": {"path": str(broken)}}, model_dir)
        wait_for(lambda: len(reloads(app)) == 1, 30, "the reload recorded")
        record = reloads(app)[-1]
        assert record["result"] == "failed" and "keeps its old weights" in record["error"], record
        assert daemon.models["demo"].runtime is runtime and daemon.ledger.allocated == allocated
        assert decode_text(app.line("DECODE a 4"))
        assert first


def test_a_removed_model_is_retired_until_its_last_agent_leaves(model_dir: Path) -> None:
    models = {"demo": {"path": str(model_dir / "tiny.gguf")}, "other": {"path": str(model_dir / "tiny_b.gguf")}}
    with running(models, model_dirs=[model_dir], watch=True) as app:
        daemon = app.daemon
        assert app.line("REGISTER a other").startswith("OK")
        rewrite(app, {"demo": models["demo"]}, model_dir)
        wait_for(lambda: len(reloads(app)) == 1, 10, "the reload recorded")
        model_line = next(line for line in app.line("STATUS").splitlines() if "name=other" in line)
        assert "retired=yes" in model_line and "state=loaded" in model_line
        assert app.line("REGISTER b other").startswith("ERR UNKNOWN_MODEL")
        assert decode_text(app.line("DECODE a 4 Hello"))  # its agent keeps working
        assert app.line("UNREGISTER a").startswith("OK")
        wait_for(lambda: "other" not in daemon.models, 10, "the retired model gone")
        assert "name=other" not in app.line("STATUS") and daemon.ledger.allocated == 0


def test_data_dir_and_device_wait_for_a_restart(model_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("appliance")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the reload sets it
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        state = app.appliance.config.data_dir
        text = config_text(demo, state=state, model_dirs=[model_dir], device="fake:4GiB", log_level="debug")
        app.edit(text.replace(f"data_dir: {state}", f"data_dir: {tmp_path / 'elsewhere'}"))
        wait_for(lambda: len(reloads(app)) == 1, 10, "the reload recorded")
        record = reloads(app)[-1]
        assert record["result"] == "applied" and set(record["restart_needed"]) == {"data_dir", "device"}
        assert "restart needed for data_dir, device" in record["applied"]
        assert app.appliance.config.data_dir == state and app.appliance.config.device == "fake:8GiB"
        assert app.appliance.config.log_level == "debug"  # the rest applied
        assert logging.getLogger("appliance").level == logging.DEBUG
        assert not (tmp_path / "elsewhere").exists()


# -- systemd notify -----------------------------------------------------------------------------------------
class NotifySocket:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.1)
        self.messages: list[dict[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append(fields)

    def states(self) -> list[str]:
        names = ("READY", "RELOADING", "STOPPING")
        return [name for message in self.messages for name in names if message.get(name) == "1"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_notify_says_ready_reloading_ready_stopping_in_order_and_pings_the_watchdog(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    systemd = NotifySocket(tmp_path)
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    try:
        with running(demo, model_dirs=[model_dir], watch=True, notifier=Notifier(str(systemd.path))) as app:
            wait_for(lambda: systemd.states() == ["READY"], 10, "READY=1")
            rewrite(app, demo, model_dir, admission_percent=80)
            wait_for(lambda: systemd.states() == ["READY", "RELOADING", "READY"], 10, "RELOADING=1 then READY=1")
            reloading = next(message for message in systemd.messages if message.get("RELOADING") == "1")
            now_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            assert 0 < now_usec - int(reloading["MONOTONIC_USEC"]) < 60_000_000
            ready = [message for message in systemd.messages if message.get("READY") == "1"]
            assert "model(s) loaded" in ready[-1]["STATUS"]
            wait_for(lambda: sum(message.get("WATCHDOG") == "1" for message in systemd.messages) >= 3, 5,
                     "watchdog pings")
        wait_for(lambda: systemd.states() == ["READY", "RELOADING", "READY", "STOPPING"], 10, "STOPPING=1")
    finally:
        systemd.close()


# -- graceful stop ------------------------------------------------------------------------------------------
def stop_in_background(app: Running) -> threading.Thread:
    thread = threading.Thread(target=app.call, args=(app.appliance.stop(),), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("grace_s, completes", [(30, True), (0.3, False)], ids=["finishes", "shutting-down"])
def test_sigterm_during_a_decode_on_the_line_protocol(model_dir: Path, grace_s: float, completes: bool) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], shutdown_grace_s=grace_s) as app:
        assert app.line("REGISTER a demo").startswith("OK")
        app.engine.delay_s = 0.03 if completes else 0.2
        session = LineSession(app.socket)
        try:
            session.send("DECODE a 40 Hello")
            wait_for(lambda: app.daemon.generating > 0, 30, "the decode running")
            time.sleep(0.2)
            stopper = stop_in_background(app)
            reply = read_reply(session.stream)
            stopper.join(60)
        finally:
            session.close()
        if completes:
            assert header_fields(reply)["generated_tokens"] == "40", reply
        else:
            assert reply.startswith("ERR SHUTTING_DOWN"), reply
        assert not app.socket.exists()


@pytest.mark.parametrize("grace_s, completes", [(30, True), (0.3, False)], ids=["finishes", "shutting-down"])
def test_sigterm_during_a_magn_stream(model_dir: Path, grace_s: float, completes: bool) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], shutdown_grace_s=grace_s) as app:
        app.engine.delay_s = 0.03 if completes else 0.2
        peer = RawPeer(app.socket)
        try:
            peer.send({"type": "INFER_REQUEST", "task_id": "t", "model": "demo", "prompt": "Hello",
                       "max_tokens": 40, "temperature": 0, "stream": True})
            assert isinstance(peer.read_token(), m.StreamToken)
            stopper = stop_in_background(app)
            messages = peer.read_until_end("t")
            stopper.join(60)
        finally:
            peer.close()
        end = messages[-1]
        if completes:
            assert isinstance(end, m.TaskComplete) and end.usage.completion_tokens == 40
        else:
            assert isinstance(end, m.ErrorMessage) and end.error.code == "SHUTTING_DOWN"
            assert end.error.details["completion_tokens"] < 40
        assert not app.socket.exists()
        assert not os.path.exists(app.appliance.config.data_dir / "registry.json")


def sse_events(response: httpx.Response) -> list[dict[str, Any] | str]:
    """The ``data:`` events of an OpenAI stream, decoded (``"[DONE]"`` as it is)."""
    events: list[dict[str, Any] | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("grace_s, completes", [(30, True), (0.3, False)], ids=["finishes", "shutting-down"])
def test_sigterm_during_an_openai_stream(model_dir: Path, grace_s: float, completes: bool) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], shutdown_grace_s=grace_s) as app:
        app.engine.delay_s = 0.03 if completes else 0.2
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 40, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{app.appliance.http_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            wait_for(lambda: app.daemon.generating > 0, 30, "the stream running")
            time.sleep(0.2)
            stopper = stop_in_background(app)
            events = sse_events(response)
        stopper.join(60)
        if completes:
            assert events[-1] == "[DONE]"
            finish = [event["choices"][0]["finish_reason"] for event in events[:-1] if event["choices"]]
            assert finish[-1] == "length"
        else:
            errors = [event["error"] for event in events if isinstance(event, dict) and "error" in event]
            assert errors and errors[-1]["code"] == "SHUTTING_DOWN", events[-3:]
        assert not app.socket.exists()


def test_a_stream_in_flight_finishes_on_the_old_http_port(model_dir: Path) -> None:
    demo = {"demo": {"path": str(model_dir / "tiny.gguf")}}
    with running(demo, model_dirs=[model_dir], watch=True) as app:
        old_url = app.appliance.http_url
        app.engine.delay_s = 0.05
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 30, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{old_url}/v1/completions", json=body, timeout=60) as response:
            wait_for(lambda: app.daemon.generating > 0, 30, "the stream running")
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            rewrite(app, demo, model_dir, http={"host": "127.0.0.1", "port": port})
            wait_for(lambda: app.appliance.http_url == f"http://127.0.0.1:{port}", 10, "HTTP moved")
            assert refused(old_url)  # no new connections on the old port...
            events = sse_events(response)  # ...but the request in flight finishes there
        assert events[-1] == "[DONE]"
        text = "".join(event["choices"][0]["text"] for event in events[:-1] if event["choices"])
        assert text

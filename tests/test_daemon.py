"""The real daemon on a temporary socket with real tiny models, driven over the line protocol (L1–L7, R2–R4)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from harness import running

from appliance.client import lines as lineclient
from appliance.engine.runtime import Sampling

GiB = 1024**3


def fields(reply: str) -> dict[str, str]:
    return lineclient.header_fields(reply)


def test_register_decode_in_l6_format(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        assert app.line("REGISTER smol tiny").startswith("OK schema=lmx-daemon/1\nOK invoke=REGISTER agent_id=smol")
        reply = app.line("DECODE smol 16 Hello world")
        lines = reply.splitlines()
        assert lines[0] == "OK schema=lmx-daemon/1"
        assert lines[1] == "OK invoke=DECODE agent_id=smol"
        assert lines[2].startswith("OK prompt_tokens=3 generated_tokens=")
        assert lines[3].startswith("OK elapsed_ms=")
        assert lines[4] == "OK kv_swap_evicted=none kv_swap_restored=false kv_restored_from=none"
        assert lines[5] == "BEGIN_RESPONSE" and lines[-1] == "END_RESPONSE"
        head = fields(reply)
        eos = head["stopped_on_eos"] == "true"
        assert int(head["generated_tokens"]) == 16 or eos
        assert float(head["elapsed_ms"]) > 0
        assert lineclient.response_body(reply).strip(), "the real model generated text"


def test_bad_input_gets_err_lines_and_the_connection_keeps_working(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app, \
            socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(app.socket))
        stream = sock.makefile("rw", encoding="utf-8", newline="\n")
        replies = []
        for line in ["FROB", "DECODE x", "DECODE ghost 4 hi", "REGISTER a nosuchmodel", "REGISTER a tiny",
                     "REGISTER a tiny", "DECODE a 4 Hi"]:
            stream.write(line + "\n")
            stream.flush()
            replies.append(lineclient.read_reply(stream))
        codes = [r.split()[1] if r.startswith("ERR") else "OK" for r in replies]
        assert codes == ["UNKNOWN_COMMAND", "BAD_REQUEST", "UNKNOWN_AGENT", "UNKNOWN_MODEL", "OK", "AGENT_EXISTS",
                         "OK"]
        assert replies[-1].rstrip().endswith("END_RESPONSE")


def test_health_answers_from_memory_while_a_decode_runs(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        url = app.appliance.http_url + "/v1/health"
        doc = httpx.get(url).json()
        assert doc["status"] == "ok" and doc["models"][0]["name"] == "tiny" and doc["context_length"] == 2048
        missing = httpx.get(app.appliance.http_url + "/v1/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND"
        wrong = httpx.post(url)
        assert wrong.status_code == 405 and set(wrong.json()["error"]) >= {"code", "message", "retryable", "details"}
        app.line("REGISTER a tiny")
        app.engine.gate.close()  # the decode below holds the engine thread until the gate opens
        worker = threading.Thread(target=app.line, args=("DECODE a 60 Hello",))
        worker.start()
        app.engine.gate.wait_arrived(1)
        times = []
        for _ in range(10):
            start = time.perf_counter()
            assert httpx.get(url).status_code == 200
            times.append(time.perf_counter() - start)
        assert app.engine.gate.held == 1  # the decode was running all along
        app.engine.gate.open()
        worker.join()
        assert sorted(times)[5] < 0.25, times  # a generous bound for a loaded 2-core machine


def test_three_models_fit_and_a_fourth_is_denied_with_the_exact_line(model_dir: Path) -> None:
    estimate = int(2.3 * GiB)
    models = {name: {"path": str(model_dir / "tiny.gguf"), "vram_bytes": estimate} for name in "abcd"}
    with running(models, model_dirs=[model_dir], device="fake:8GiB", admission_percent=90) as app:
        for i, name in enumerate("abc"):
            assert fields(app.line(f"REGISTER agent{i} {name}"))["ledger_allocated_bytes"] == str(estimate * (i + 1))
        cap = int(0.9 * 8 * GiB)
        assert app.line("REGISTER agent3 d") == (
            f"ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes={cap} ledger_allocated_bytes={3 * estimate} "
            f"requested_table_bytes={estimate}\n")
        assert app.daemon.ledger.allocated == 3 * estimate
        assert "d" not in app.daemon.models or app.daemon.models["d"].runtime is None


def test_200_concurrent_registers_never_overrun_the_cap(model_dir: Path) -> None:
    names = [f"m{i}" for i in range(8)]
    models = {name: {"path": str(model_dir / "tiny_b.gguf"), "vram_bytes": "2GiB"} for name in names}
    with running(models, model_dirs=[model_dir], device="fake:8GiB", max_connections=256) as app:
        ledger = app.daemon.ledger
        peak = [0]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], ledger.snapshot().allocated)

        watcher = threading.Thread(target=watch)
        watcher.start()
        barrier = threading.Barrier(200)
        replies: list[str] = [""] * 200

        def register(i: int) -> None:
            barrier.wait()
            replies[i] = app.line(f"REGISTER agent{i} {names[i % len(names)]}")

        threads = [threading.Thread(target=register, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
        admitted = [r for r in replies if r.startswith("OK")]
        refused = [r for r in replies if r.startswith("ERR VRAM_LEDGER_DENY code=CAP")]
        assert len(admitted) + len(refused) == 200
        assert peak[0] <= ledger.cap and ledger.allocated <= ledger.cap
        loaded = [m for m in app.daemon.models.values() if m.runtime is not None]
        assert len(loaded) == ledger.cap // (2 * GiB) == 3
        assert len(admitted) == 25 * 3  # every agent of an admitted model shares its single load


def test_failed_load_after_reserve_leaves_the_ledger_as_before(model_dir: Path) -> None:
    corrupt = model_dir / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    models = {"tiny": {"path": str(model_dir / "tiny.gguf"), "vram_bytes": "1GiB"},
              "broken": {"path": str(corrupt), "vram_bytes": "1GiB"},
              "broken_auto": {"path": str(corrupt)}}
    with running(models, model_dirs=[model_dir]) as app:
        app.line("REGISTER a tiny")
        before = app.daemon.ledger.snapshot()
        for model in ("broken", "broken_auto"):
            reply = app.line(f"REGISTER b {model}")
            assert reply.startswith("ERR MODEL_LOAD_FAILED"), reply
            after = app.daemon.ledger.snapshot()
            assert (after.allocated, dict(after.reservations)) == (before.allocated, dict(before.reservations))
        assert "b" not in app.daemon.agents
        assert app.line("REGISTER b tiny").startswith("OK")  # the id was not left claimed


def _tokens(app, agent: str, n: int, prompt: str) -> tuple[list[int], object]:  # type: ignore[no-untyped-def]
    result = app.call(app.daemon.decode(agent, n, prompt, Sampling()))
    return list(result.generation.tokens), result


@pytest.mark.parametrize("other_model", ["tiny", "tiny_b"])
def test_swap_continues_exactly_like_an_uninterrupted_run(model_dir: Path, other_model: str) -> None:
    models = {"tiny": {"path": str(model_dir / "tiny.gguf")}, "tiny_b": {"path": str(model_dir / "tiny_b.gguf")}}
    with running(models, model_dirs=[model_dir], engine={"live_slots": 1}) as app:
        for agent, model in (("ref", "tiny"), ("a", "tiny"), ("b", other_model)):
            app.line(f"REGISTER {agent} {model}")
        reference, _ = _tokens(app, "ref", 32, "Hello world")
        first, r1 = _tokens(app, "a", 16, "Hello world")
        assert r1.evicted == "ref" and r1.restored is False
        _, rb = _tokens(app, "b", 16, "Something else entirely")
        second, r2 = _tokens(app, "a", 16, "")
        if other_model == "tiny":
            assert rb.evicted == "a" and r2.evicted == "b" and r2.restored is True
        assert first + second == reference
        reply = app.line("DECODE a 4")
        assert "OK kv_swap_evicted=none kv_swap_restored=false" in reply


def test_three_agents_interleaved_match_their_uninterrupted_runs(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 engine={"live_slots": 1}) as app:
        prompts = {"a": "Hello world", "b": "The cat", "c": "Numbers 1 2 3"}
        reference = {}
        for agent, prompt in prompts.items():
            app.line(f"REGISTER ref_{agent} tiny")
            reference[agent], _ = _tokens(app, f"ref_{agent}", 24, prompt)
            app.line(f"REGISTER {agent} tiny")
        got: dict[str, list[int]] = {agent: [] for agent in prompts}
        restored = 0
        for round_ in range(3):
            for agent, prompt in prompts.items():
                tokens, result = _tokens(app, agent, 8, prompt if round_ == 0 else "")
                got[agent] += tokens
                restored += result.restored
        assert got == reference
        assert restored == 6  # every turn after the first round found its state in host RAM
        status = app.line("STATUS")
        assert "state=host" in status and "state=device" in status


def test_client_killed_mid_decode_leaves_nothing_behind(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf"), "vram_bytes": "1GiB"}},
                 model_dirs=[model_dir]) as app:
        daemon = app.daemon
        app.line("REGISTER a tiny")
        gate = app.engine.gate
        gate.close()
        gate.release(2)
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(str(app.socket))
        sock.sendall(b"DECODE a 400 Hello\n")
        gate.wait_arrived(3)  # two tokens out, the third held: only a cancel can end this decode now
        sock.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (daemon.models["tiny"].inflight or daemon.agents["a"].lock.locked()):
            time.sleep(0.05)
        assert daemon.models["tiny"].inflight == 0 and not daemon.agents["a"].lock.locked()
        assert len(app.appliance.socket_server.connections) == 0
        assert gate.held == 0 and gate.passed == 2
        assert daemon.agents["a"].conversation.tokens == []  # the cancelled DECODE was rolled back
        gate.open()
        assert fields(app.line("DECODE a 4 Hello"))["generated_tokens"] in ("4", "1", "2", "3")
        app.line("UNREGISTER a")
        assert daemon.ledger.allocated == 0 and not daemon.agents
        assert daemon.models["tiny"].runtime is None


def test_register_by_path_is_confined_to_the_model_dirs(model_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.gguf"
    shutil.copy(model_dir / "tiny.gguf", outside)
    (model_dir / "escape.gguf").symlink_to(outside)
    (model_dir / "notes.gguf").write_text("not a model")
    with running({}, model_dirs=[model_dir]) as app:
        assert stat.S_IMODE(os.stat(app.socket).st_mode) == 0o660
        assert app.line(f"REGISTER a {model_dir / 'tiny.gguf'}").startswith("OK")
        assert app.line(f"REGISTER b {outside}").startswith("ERR FORBIDDEN")
        assert app.line(f"REGISTER b {model_dir / 'escape.gguf'}").startswith("ERR FORBIDDEN")
        assert app.line(f"REGISTER b {model_dir / '..' / 'outside.gguf'}").startswith("ERR FORBIDDEN")
        assert app.line(f"REGISTER b {model_dir / 'notes.gguf'}").startswith("ERR BAD_REQUEST")
        assert app.line(f"REGISTER b {model_dir / 'missing.gguf'}").startswith("ERR UNKNOWN_MODEL")
        assert app.daemon.ledger.allocated == app.daemon.models[str(model_dir / "tiny.gguf")].estimate


def test_status_shows_device_ledger_models_agents_and_measured_bytes(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        app.line("REGISTER a tiny")
        status = app.line("STATUS")
        assert "device name=" in status and "total_bytes=8589934592" in status
        assert "measured_bytes=none" in status
        app.line("DECODE a 4 Hello")
        status = app.line("STATUS")
        model_line = next(line for line in status.splitlines() if line.startswith("model "))
        assert "refcount=1" in model_line and "loaded=true" in model_line
        assert "measured_bytes=none" not in model_line
        estimate = app.daemon.models["tiny"].estimate
        assert f"estimate_bytes={estimate}" in model_line and estimate > 0
        assert "agent id=a model=tiny tokens=" in status
        socket_line = next(line for line in status.splitlines() if line.startswith("socket "))
        assert "connections=1 max_connections=128" in socket_line and "buffer_asked_bytes=4194304" in socket_line
        assert int(socket_line.split("sndbuf_granted_bytes=")[1].split()[0]) > 0
        listing = app.line("LIST")
        assert "model name=tiny" in listing and "vram_bytes=auto" in listing


def test_last_unregister_frees_the_model_and_idle_ttl_unloads_anonymous_use(model_dir: Path) -> None:
    models = {"tiny": {"path": str(model_dir / "tiny.gguf"), "idle_ttl_s": 0.3}}
    with running(models, model_dirs=[model_dir]) as app:
        daemon = app.daemon
        app.line("REGISTER a tiny")
        app.line("REGISTER b tiny")
        assert daemon.models["tiny"].refcount == 2
        app.line("UNREGISTER a")
        assert daemon.models["tiny"].runtime is not None
        app.line("UNREGISTER b")
        assert daemon.models["tiny"].runtime is None and daemon.ledger.allocated == 0
        app.call(daemon.complete("tiny", 4, "Hello"))
        assert daemon.models["tiny"].runtime is not None and daemon.ledger.allocated > 0
        deadline = time.monotonic() + 10
        while (daemon.models["tiny"].runtime is not None or daemon.ledger.allocated) and time.monotonic() < deadline:
            time.sleep(0.05)  # an unload drops the runtime first, then releases its bytes once it is closed
        assert daemon.models["tiny"].runtime is None and daemon.ledger.allocated == 0


def test_resync_rebases_the_cap_when_other_processes_grow(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        daemon = app.daemon
        before = daemon.ledger.cap
        daemon.device.set_used(2 * GiB)
        reply = app.line("RESYNC")
        assert fields(reply)["ledger_max_bytes"] == str(before - 2 * GiB)
        assert daemon.ledger.cap == before - 2 * GiB

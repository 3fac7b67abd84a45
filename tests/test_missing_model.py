"""A configured model whose file is not there: the config stays valid, the other models serve, that one is ``missing``
(health ``degraded`` naming its key path and line, requests refused with ``MODEL_MISSING``) and it serves as soon as
its file is there, without a reload or a restart."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from harness import RawPeer, running

from appliance.config.modelfiles import missing_model, missing_models
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.protocol import messages as m
from appliance.protocol.lines import parse_reply

ROOT = Path(__file__).resolve().parents[1]
TEXT = textwrap.dedent("""\
    models:
      - name: here
        path: here.gguf
      - name: gone
        aliases: [g]
        path: gone.gguf
      - name: demo
        path: demo.gguf
        generate_if_missing: {layers: 1, dim: 64}
    """)


# --- the config (pure) --------------------------------------------------------------------------------------------


def test_a_missing_model_file_does_not_make_the_config_invalid() -> None:
    config = parse_config(TEXT, base_dir=Path("/m"))
    assert [model.name for model in config.models] == ["here", "gone", "demo"]
    assert config.lines["models[1].path"] == 6


def test_the_missing_models_are_named_with_their_key_path_and_line() -> None:
    config = parse_config(TEXT, source=Path("/etc/appliance/appliance.yaml"))
    there = {Path("/etc/appliance/here.gguf")}
    found = missing_models(config, lambda path: path in there)
    assert [(m.name, m.key, m.line) for m in found] == [("gone", "models[1].path", 6), ("demo", "models[2].path", 8)]
    assert found[0].reason == ("model gone is missing: no such file /etc/appliance/gone.gguf "
                               "(/etc/appliance/appliance.yaml:6 models[1].path)")
    assert [m.name for m in missing_models(config, lambda path: path in there, skip_generated=True)] == ["gone"]
    assert missing_model(config, "here", lambda path: path in there) is None
    assert missing_model(config, "nobody", lambda path: False) is None
    error = found[0].error()
    assert error.code == "MODEL_MISSING" and error.http_status == 503 and not error.retryable
    assert error.details["key"] == "models[1].path" and error.details["line"] == 6


def test_check_files_still_refuses_a_missing_file_when_asked() -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse_config(TEXT, base_dir=Path("/m"), check_files=lambda path: path.name == "here.gguf")
    assert [(p.path, p.line) for p in info.value.problems] == [("models[1].path", 6)]


def test_config_check_warns_and_exits_0_unless_strict(tmp_path: Path, tiny_model: Path) -> None:
    config = tmp_path / "appliance.yaml"
    config.write_text(TEXT)
    shutil.copy(tiny_model, tmp_path / "here.gguf")
    done = subprocess.run([sys.executable, "-m", "appliance", "config", "check", str(config)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    warning, summary = done.stdout.strip().splitlines()
    assert warning.startswith(f"warning: {config}:6: models[1].path: no such file {tmp_path / 'gone.gguf'}")
    assert summary.endswith("; 1 warning(s)")  # the demo model is written at start: no warning
    strict = subprocess.run([sys.executable, "-m", "appliance", "config", "check", "--strict", str(config)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert strict.returncode == 1 and strict.stdout == done.stdout


# --- a real appliance -----------------------------------------------------------------------------------------------


def health(app) -> dict:  # type: ignore[no-untyped-def]
    return httpx.get(f"{app.appliance.http_url}/v1/health", timeout=10).json()


def test_the_rest_serves_and_the_model_serves_once_its_file_is_there(tmp_path: Path, tiny_model: Path,
                                                                      tiny_model_b: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "a.gguf")
    gone = folder / "b.gguf"
    models = {"a": {"path": str(folder / "a.gguf"), "n_ctx": 256},
              "b": {"path": str(gone), "n_ctx": 256, "aliases": ["bee"]}}
    with running(models, model_dirs=[folder]) as app:
        doc = health(app)
        assert doc["status"] == "degraded"
        assert {m["name"]: m["state"] for m in doc["models"]} == {"a": "available", "b": "missing"}
        assert f"model b is missing: no such file {gone}" in doc["reason"] and "models[1].path" in doc["reason"]
        (entry,) = doc["missing_models"]
        assert entry["key"] == "models[1].path" and entry["line"] == app.appliance.config.lines["models[1].path"]

        refused = parse_reply(app.line("REGISTER x bee"))
        assert refused.error is not None and refused.error.code == "MODEL_MISSING"
        assert refused.error.details["path"] == str(gone) and refused.error.details["key"] == "models[1].path"
        assert "x" not in app.daemon.agents
        api = httpx.post(f"{app.appliance.http_url}/v1/completions", timeout=30,
                         json={"model": "b", "prompt": "Hello", "max_tokens": 2})
        assert api.status_code == 503 and api.json()["error"]["code"] == "MODEL_MISSING"
        peer = RawPeer(app.socket)
        try:
            peer.send({"type": "INFER_REQUEST", "task_id": "t", "model": "b", "prompt": "Hello", "max_tokens": 2})
            end = peer.read_until_end("t")[-1]
        finally:
            peer.close()
        assert isinstance(end, m.ErrorMessage) and end.error.code == "MODEL_MISSING", end
        dashboard = httpx.get(f"{app.appliance.http_url}/admin/_dashboard", timeout=10)
        assert dashboard.status_code == 200 and '<span class="state state-missing">missing</span>' in dashboard.text

        assert app.line("REGISTER y a").startswith("OK")  # the other model serves
        assert "OK prompt_tokens=" in app.line("DECODE y 4 Hello")
        status = app.line("STATUS")
        assert "model name=b state=missing" in status and "model name=a state=loaded" in status
        assert "state=missing" in app.line("LIST")
        metrics = httpx.get(f"{app.appliance.http_url}/metrics", timeout=10).text
        assert 'appliance_models{state="missing"} 1.0' in metrics

        shutil.copy(tiny_model_b, gone)  # the file is back: no reload, no restart
        assert health(app)["status"] == "ok"
        assert app.line("REGISTER z bee").startswith("OK")
        assert "OK prompt_tokens=" in app.line("DECODE z 4 Hello")
        assert {m["name"]: m["state"] for m in health(app)["models"]} == {"a": "loaded", "b": "loaded"}


def test_an_appliance_process_starts_with_a_model_file_missing(tmp_path: Path, tiny_model: Path) -> None:
    """``appliance run`` (a real process) starts, logs the missing model once, and serves the other."""
    shutil.copy(tiny_model, tmp_path / "here.gguf")
    config = tmp_path / "appliance.yaml"
    config.write_text(f"data_dir: {tmp_path / 'state'}\ndevice: fake:8GiB\nhttp: {{port: 0}}\n"
                      f"models:\n  - {{name: here, path: here.gguf, n_ctx: 256}}\n"
                      f"  - {{name: gone, path: gone.gguf}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        registry = tmp_path / "state" / "registry.json"
        deadline = time.monotonic() + 60
        while not registry.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the appliance did not come up"
            time.sleep(0.1)
        cli = [sys.executable, "-m", "appliance"]
        states = subprocess.run([*cli, "list", "--json", "--config", str(config)], capture_output=True, text=True,
                                timeout=60, cwd=ROOT)
        assert '"state": "missing"' in states.stdout, states.stdout + states.stderr
        served = subprocess.run([*cli, "register", "a", "here", "--config", str(config)], capture_output=True,
                                text=True, timeout=60, cwd=ROOT)
        assert served.returncode == 0, served.stdout
        refused = subprocess.run([*cli, "register", "b", "gone", "--config", str(config)], capture_output=True,
                                 text=True, timeout=60, cwd=ROOT)
        assert refused.returncode == 1 and refused.stdout.startswith("ERR MODEL_MISSING")
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert output.count("model gone is missing: no such file") == 1, output

"""A careless operator types the API token unquoted (``api_token: 987654321``, an easy slip): the file is refused,
and the intended secret must not appear anywhere the appliance speaks: the reload's log line, ``/v1/health``'s reason,
``STATUS`` on the socket, the admin Config page (its file view and its messages), the SIGUSR1 state dump."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import pytest
import yaml
from harness import running

from appliance.config import secrets

TOKEN = "running-token-5c1e"
TYPED = "987654321"


def test_a_refused_token_is_shown_nowhere(tiny_model: Path, record_case, caplog: pytest.LogCaptureFixture) -> None:
    record_case()
    caplog.set_level(logging.INFO)
    secrets.guard_logs()  # the caplog handler is new: the appliance guards the handlers there are at its start
    with running({"demo": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True,
                 http_settings={"host": "127.0.0.1", "port": 0, "api_token": TOKEN}) as app:
        secrets.guard_logs()
        doc = yaml.safe_load(app.config_file.read_text())
        assert doc["http"]["api_token"] == TOKEN
        app.edit(app.config_file.read_text().replace(TOKEN, TYPED))
        assert yaml.safe_load(app.config_file.read_text())["http"]["api_token"] == int(TYPED)
        record = app.reload()
        assert record.result == "invalid"
        url = app.appliance.http_url
        headers = {"Authorization": f"Bearer {TOKEN}"}  # the running config's token still guards HTTP
        health = httpx.get(url + "/v1/health", headers=headers, timeout=30)
        assert health.json()["status"] == "degraded" and "http.api_token" in health.json()["reason"]
        page = httpx.get(url + "/admin/config", headers=headers, timeout=30).text
        assert "http.api_token" in page and "api_token:" in page
        status = app.line("STATUS")
        assert "invalid" in status
        dumped = app.appliance.dump_state()
        json.loads(dumped)
        time.sleep(0.1)
        logged = caplog.text
        assert "http.api_token" in logged  # the refusal was logged, without the value
        for place, text in {"health": health.text, "config page": page, "STATUS": status, "dump": dumped,
                            "log": logged, "reload record": json.dumps(record.to_dict())}.items():
            assert TYPED not in text, f"the typed token is in the {place}"
            assert TOKEN not in text, f"the running token is in the {place}"

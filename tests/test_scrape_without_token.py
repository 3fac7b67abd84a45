"""``http.scrape_without_token``: ``/metrics`` and the health document answer without the API token when the
operator says so, every other route still needs it; the config refuses it on a public address unless
``http.confirm_public_scrape`` confirms it; a reload applies it (and ``http.instance_name``) to the next request."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml
from harness import config_text, running

from appliance.config import diff as config_diff
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.http.security import scrape_allowed
from appliance.supervisor.plan import plan

TOKEN = "scrape-secret-token-1"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def http_config(**http: object) -> str:
    return yaml.safe_dump({"http": http})


@pytest.mark.parametrize(("http", "refused"), [
    ({"scrape_without_token": True}, False),  # loopback: no token at all, nothing to skip
    ({"api_token": TOKEN, "scrape_without_token": True}, False),  # loopback with a token
    ({"host": "localhost", "api_token": TOKEN, "scrape_without_token": True}, False),
    ({"host": "0.0.0.0", "api_token": TOKEN, "scrape_without_token": True}, True),  # public: needs confirming
    ({"host": "192.0.2.7", "api_token": TOKEN, "scrape_without_token": True}, True),
    ({"host": "0.0.0.0", "api_token": TOKEN, "scrape_without_token": True, "confirm_public_scrape": True}, False),
    ({"host": "0.0.0.0", "api_token": TOKEN, "confirm_public_scrape": True}, False),  # confirming alone: no effect
    ({"host": "0.0.0.0", "api_token": TOKEN}, False),
])
def test_validation_refuses_a_public_scrape_unless_it_is_confirmed(tmp_path: Path, http: dict[str, object],
                                                                  refused: bool) -> None:
    text = http_config(**http)
    if not refused:
        config = parse_config(text, base_dir=tmp_path)
        assert config.http.scrape_without_token is http.get("scrape_without_token", False)
        return
    with pytest.raises(ConfigInvalid) as info:
        parse_config(text, base_dir=tmp_path)
    [problem] = info.value.problems
    assert problem.path == "http.scrape_without_token"
    for named in ("http.confirm_public_scrape", "not loopback", "model names, queue depth and load"):
        assert named in problem.message


@pytest.mark.parametrize(("method", "path", "setting", "allowed"), [
    ("GET", "/metrics", True, True),
    ("HEAD", "/metrics", True, True),
    ("GET", "/v1/health", True, True),
    ("GET", "/health", True, True),
    ("GET", "/metrics", False, False),
    ("GET", "/v1/health", False, False),
    ("POST", "/metrics", True, False),
    ("GET", "/v1/models", True, False),
    ("POST", "/v1/chat/completions", True, False),
    ("GET", "/admin/", True, False),
    ("GET", "/metrics/", True, False),
    ("GET", "/v1/health/x", True, False),
])
def test_only_the_scrape_paths_are_let_through(method: str, path: str, setting: bool, allowed: bool) -> None:
    assert scrape_allowed(method, path, setting) is allowed


def test_the_settings_apply_live_on_reload(tmp_path: Path) -> None:
    old = parse_config("", base_dir=tmp_path)
    new = parse_config(http_config(scrape_without_token=True, confirm_public_scrape=True,
                                   instance_name="box-2"), base_dir=tmp_path)
    found = config_diff.diff(old, new)
    changed = ("http.scrape_without_token", "http.confirm_public_scrape", "http.instance_name")
    assert found.changed_settings == changed and found.restart_settings == ()
    reload = plan(found)
    assert reload.live_settings == changed and not reload.rebind_http and not reload.restart_needed


def get(url: str, path: str, **headers: str) -> httpx.Response:
    return httpx.get(url + path, headers=headers, timeout=60)


@pytest.mark.parametrize("scrape", [True, False])
def test_a_real_server_answers_the_scrape_paths_without_the_token_only_when_allowed(tiny_model: Path,
                                                                                    scrape: bool) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"api_token": TOKEN, "scrape_without_token": scrape}) as app:
        url = app.appliance.http_url
        for path in ("/metrics", "/v1/health", "/health"):
            reply = get(url, path)
            if scrape:
                assert reply.status_code == 200, (path, reply.text)
            else:
                assert reply.status_code == 401 and reply.json()["error"]["code"] == "UNAUTHORIZED", path
        if scrape:
            assert "vllm:num_requests_waiting" in get(url, "/metrics").text
            assert get(url, "/v1/health").json()["status"] in ("ok", "loading")
        # every other route still requires the token
        chat = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "UNAUTHORIZED"
        assert get(url, "/v1/models").status_code == 401
        assert httpx.post(url + "/metrics", timeout=60).status_code == 401
        admin = get(url, "/admin/", accept="text/html")
        assert admin.status_code == 303 and admin.headers["location"] == "/admin/login"  # the login form
        assert get(url, "/admin/").status_code == 401
        # with the token, all of it as before
        authorization = f"Bearer {TOKEN}"
        assert get(url, "/metrics", authorization=authorization).status_code == 200
        assert get(url, "/v1/models", authorization=authorization).status_code == 200
        chat = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"authorization": authorization},
                          timeout=60)
        assert chat.status_code == 200, chat.text


def test_a_reload_turns_the_scrape_on_and_off(tiny_model: Path) -> None:
    models = {"tiny": {"path": str(tiny_model)}}
    with running(models, model_dirs=[tiny_model.parent], watch=True, http_settings={"api_token": TOKEN}) as app:
        url = app.appliance.http_url
        state = app.config_file.parent
        assert get(url, "/metrics").status_code == 401
        for scrape, status in ((True, 200), (False, 401)):
            app.edit(config_text(models, state=state, model_dirs=[tiny_model.parent],
                                 http={"api_token": TOKEN, "scrape_without_token": scrape,
                                       "instance_name": f"box-{scrape}"}))
            record = app.reload()
            assert record.result == "applied", record
            assert app.appliance.http_url == url  # a live setting: no rebind
            assert get(url, "/metrics").status_code == status
            assert get(url, "/v1/health").status_code == status
            assert get(url, "/v1/models").status_code == 401
            named = get(url, "/v1/models", authorization=f"Bearer {TOKEN}")
            assert named.headers["x-appliance-instance"] == f"box-{scrape}"  # the name, live too

"""Who may use the HTTP surface (SPEC W5): the API token, cross-origin refusals and the admin CSRF token, against a
real appliance; and the refusal to start on a non-loopback address without a token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from harness import running

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "s3cret-token-for-tests"


@pytest.fixture
def open_app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        yield app


@pytest.fixture
def locked_app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"api_token": TOKEN}) as app:
        yield app


def test_a_cross_origin_post_is_refused_on_every_route(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    for path in ("/v1/chat/completions", "/admin/anything"):
        for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
            response = httpx.post(url + path, headers=headers, content=b"{}")
            assert response.status_code == 403, (path, headers, response.text)
            error = response.json()["error"]
            assert error["code"] == "FORBIDDEN" and error["message"] == "cross-origin request refused"


def test_an_admin_post_needs_the_csrf_token(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    same_origin = {"Origin": url}
    missing = httpx.post(url + "/admin/anything", headers=same_origin)
    assert missing.status_code == 403 and "CSRF" in missing.json()["error"]["message"]
    wrong = httpx.post(url + "/admin/anything", headers={**same_origin, "X-CSRF-Token": "guess"})
    assert wrong.status_code == 403
    right = httpx.post(url + "/admin/anything",
                       headers={**same_origin, "X-CSRF-Token": open_app.appliance.csrf_token})
    assert right.status_code != 403  # through the guard (whatever the route then says)
    assert httpx.get(url + "/v1/health", headers={"Origin": "http://evil.example"}).status_code == 200  # reads


def test_with_a_token_every_request_needs_it(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    for path in ("/v1/health", "/v1/models", "/metrics", "/admin/", "/static/README.md"):
        response = httpx.get(url + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "UNAUTHORIZED" and TOKEN not in response.text
    page = httpx.get(url + "/admin/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 303 and page.headers["location"] == "/admin/login"  # a browser: the login form
    wrong = httpx.get(url + "/v1/health", headers={"Authorization": f"Bearer {TOKEN}x"})
    assert wrong.status_code == 401
    right = httpx.get(url + "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert right.status_code == 200 and right.json()["status"] == "ok"


def test_the_login_form_turns_the_token_into_a_session_cookie(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    with httpx.Client(base_url=url) as browser:
        form = browser.get("/admin/login")
        assert form.status_code == 200 and 'name="token"' in form.text
        refused = browser.post("/admin/login", data={"token": "nope"}, headers={"Origin": url})
        assert refused.status_code == 401 and "appliance_session" not in browser.cookies
        accepted = browser.post("/admin/login", data={"token": TOKEN}, headers={"Origin": url})
        assert accepted.status_code == 303 and accepted.headers["location"] == "/admin/"
        cookie = browser.cookies["appliance_session"]
        assert TOKEN not in cookie and "httponly" in accepted.headers["set-cookie"].lower()
        assert "samesite=strict" in accepted.headers["set-cookie"].lower()
        assert browser.get("/v1/health").status_code == 200  # the cookie stands for the token
    forged = httpx.get(url + "/v1/health", cookies={"appliance_session": "0" * 64})
    assert forged.status_code == 401


def test_a_non_loopback_bind_without_a_token_refuses_to_start(tmp_path: Path, tiny_model: Path) -> None:
    config = tmp_path / "appliance.yaml"
    config.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "state"), "device": "fake:1GiB",
                                      "http": {"host": "0.0.0.0", "port": 0},
                                      "models": [{"name": "demo", "path": str(tiny_model)}]}))
    result = subprocess.run([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "http.host: binding to '0.0.0.0' (not loopback) requires http.api_token" in result.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made

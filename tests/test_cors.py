"""Cross-origin browser clients (``http.cors_origins``): the origin rule and the preflight answers as pure
functions, the setting's validation, and real HTTP requests against a real appliance: an allowed origin's preflight
and requests get the CORS headers and pass, another origin's are refused as before, ``/admin/`` stays closed, the
API token is still required (as a header: the session cookie does not count cross-origin), and ``/health``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from harness import running

from appliance.config.schema import parse_origin
from appliance.config.validate import ConfigInvalid, parse_config
from appliance.errors import ApplianceError
from appliance.http.cors import MAX_AGE_S, CorsRule

TOKEN = "cors-test-token-0123456789"
PAGE = "http://127.0.0.1:3000"
OTHER = "http://127.0.0.1:3001"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(("text", "expected"), [
    ("http://localhost:3000", "http://localhost:3000"),
    ("HTTPS://App.Example.com", "https://app.example.com"),
    ("https://app.example.com:443", "https://app.example.com"),
    ("http://10.0.0.5:80", "http://10.0.0.5"),
    ("http://[::1]:8081", "http://[::1]:8081"),
])
def test_an_origin_is_spelled_canonically(text: str, expected: str) -> None:
    assert parse_origin(text) == expected


@pytest.mark.parametrize("text", ["localhost:3000", "http://localhost:3000/", "http://x/app", "ftp://x",
                                  "http://x:70000", "null", "http://", "http://a..b", "", 3])
def test_what_is_not_an_origin_is_refused(text: object) -> None:
    with pytest.raises(ValueError, match="must be an origin"):
        parse_origin(text)


def config(origins: str, token: str | None = None) -> str:
    text = f"models: []\nhttp:\n  cors_origins: {origins}\n"
    return text + (f"  api_token: {token}\n" if token else "")


def test_the_setting_is_validated_with_its_line() -> None:
    assert parse_config(config("[]")).http.cors_origins == ()
    assert parse_config(config('["HTTP://Localhost:3000", "https://a.example"]')).http.cors_origins == \
        ("http://localhost:3000", "https://a.example")
    with pytest.raises(ConfigInvalid, match=r"appliance.yaml:3: http.cors_origins: must be an origin"):
        parse_config(config('["http://localhost:3000/"]'))
    with pytest.raises(ConfigInvalid, match="listed twice"):
        parse_config(config('["http://a.example", "http://a.example:80"]'))


def test_any_origin_needs_an_api_token() -> None:
    with pytest.raises(ConfigInvalid, match=r"http.cors_origins: '\*' \(any origin\) requires http.api_token"):
        parse_config(config('["*"]'))
    assert parse_config(config('["*"]', token=TOKEN)).http.cors_origins == ("*",)


def test_the_rule_answers_only_allowed_origins_on_api_paths() -> None:
    rule = CorsRule((PAGE,))
    assert rule.allows(PAGE) and rule.allows("HTTP://127.0.0.1:3000") and not rule.allows(OTHER)
    assert not rule.allows("null")
    assert dict(rule.response_headers("/v1/models", PAGE))["access-control-allow-origin"] == PAGE
    assert rule.response_headers("/v1/models", OTHER) == [("vary", "Origin")]
    assert rule.response_headers("/admin/", PAGE) == [] and rule.response_headers("/metrics", PAGE) == []
    assert dict(rule.response_headers("/health", PAGE))["access-control-allow-origin"] == PAGE
    assert CorsRule(()).response_headers("/v1/models", PAGE) == []
    assert dict(CorsRule(("*",)).response_headers("/v1/models", OTHER))["access-control-allow-origin"] == "*"


def test_a_preflight_is_answered_or_refused_by_name() -> None:
    rule = CorsRule((PAGE,))
    headers = dict(rule.preflight("/v1/chat/completions", PAGE, "POST", "Content-Type, Authorization, x-agent-id, "
                                                                        "X-Stainless-OS"))
    assert headers["access-control-allow-origin"] == PAGE
    assert headers["access-control-allow-methods"] == "GET, POST, DELETE"
    assert headers["access-control-allow-headers"] == "content-type, authorization, x-agent-id, x-stainless-os"
    assert headers["access-control-max-age"] == str(MAX_AGE_S)
    refusals = [
        (rule.preflight, ("/v1/models", OTHER, "GET", ""), "add it to http.cors_origins"),
        (CorsRule(()).preflight, ("/v1/models", PAGE, "GET", ""), "http.cors_origins is empty"),
        (rule.preflight, ("/admin/registry/load", PAGE, "POST", ""), "served on the API only"),
        (rule.preflight, ("/v1/models", PAGE, "PUT", ""), "cross-origin PUT requests are refused"),
        (rule.preflight, ("/v1/models", PAGE, "GET", "x-secret-thing"), "may not send the header 'x-secret-thing'"),
        (rule.preflight, ("/v1/models", PAGE, "GET", "x-stainless-os\x7f"), "may not send the header"),
        (rule.preflight, ("/v1/models", PAGE, "GET", ",".join(f"x-stainless-{n}" for n in range(65))),
         "at most 64 headers"),
    ]
    for preflight, arguments, message in refusals:
        with pytest.raises(ApplianceError, match=message) as refused:
            preflight(*arguments)
        assert refused.value.code == "FORBIDDEN"


@pytest.fixture
def cors_app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"cors_origins": [PAGE]}) as app:
        yield app


def preflight(url: str, path: str, origin: str, method: str = "POST",
              headers: str = "content-type") -> httpx.Response:
    return httpx.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                              "Access-Control-Request-Headers": headers}, timeout=30)


def test_an_allowed_origin_gets_its_preflight_and_its_request_through(cors_app) -> None:  # type: ignore[no-untyped-def]
    url = cors_app.appliance.http_url
    answer = preflight(url, "/v1/chat/completions", PAGE, headers="content-type,x-agent-id")
    assert answer.status_code == 204, answer.text
    assert answer.headers["access-control-allow-origin"] == PAGE
    assert answer.headers["access-control-allow-headers"] == "content-type, x-agent-id"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-max-age"] == str(MAX_AGE_S)
    browser = {"Origin": PAGE, "Sec-Fetch-Site": "same-site"}
    reply = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=browser, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.headers["access-control-allow-origin"] == PAGE and reply.headers["vary"] == "Origin"
    assert "retry-after" in reply.headers["access-control-expose-headers"]
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    cross_site = httpx.get(url + "/v1/models", headers={"Origin": PAGE, "Sec-Fetch-Site": "cross-site"})
    assert cross_site.status_code == 200 and cross_site.headers["access-control-allow-origin"] == PAGE


def test_another_origin_is_refused_as_before(cors_app) -> None:  # type: ignore[no-untyped-def]
    url = cors_app.appliance.http_url
    before = len(cors_app.daemon.requests)
    answer = preflight(url, "/v1/chat/completions", OTHER)
    assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "FORBIDDEN" and "add it to http.cors_origins" in error["message"]
    assert error["details"]["origin"] == OTHER
    refused = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"Origin": OTHER}, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["message"] == "cross-origin request refused"
    assert "access-control-allow-origin" not in refused.headers
    assert len(cors_app.daemon.requests) == before  # nothing ran


def test_the_admin_page_stays_closed_to_an_allowed_origin(cors_app) -> None:  # type: ignore[no-untyped-def]
    url = cors_app.appliance.http_url
    answer = preflight(url, "/admin/registry/load", PAGE)
    assert answer.status_code == 403 and "API only" in answer.json()["error"]["message"]
    post = httpx.post(url + "/admin/registry/load", data={"model": "tiny"},
                      headers={"Origin": PAGE, "X-CSRF-Token": cors_app.appliance.csrf_token})
    assert post.status_code == 403 and post.json()["error"]["message"] == "cross-origin request refused"
    assert "access-control-allow-origin" not in post.headers
    assert cors_app.daemon.model_state("tiny") == "available"


def test_without_the_setting_a_preflight_is_refused_and_no_header_is_sent(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        url = app.appliance.http_url
        answer = preflight(url, "/v1/models", PAGE, method="GET")
        assert answer.status_code == 403 and "http.cors_origins is empty" in answer.json()["error"]["message"]
        reply = httpx.get(url + "/v1/models", headers={"Origin": PAGE})
        assert reply.status_code == 200
        assert "access-control-allow-origin" not in reply.headers and "vary" not in reply.headers


def test_the_api_token_stays_required_and_only_as_a_header(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"cors_origins": [PAGE], "api_token": TOKEN}) as app:
        url = app.appliance.http_url
        answer = preflight(url, "/v1/models", PAGE, method="GET", headers="authorization")
        assert answer.status_code == 204  # a preflight carries no credentials
        page = {"Origin": PAGE}
        missing = httpx.get(url + "/v1/models", headers=page)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "UNAUTHORIZED"
        assert missing.headers["access-control-allow-origin"] == PAGE  # the page can read why
        with httpx.Client(base_url=url) as client:  # a browser logged in to the admin page
            assert client.post("/admin/login", data={"token": TOKEN}, headers={"Origin": url}).status_code == 303
            assert client.get("/v1/models").status_code == 200  # same origin: the cookie counts
            assert client.get("/v1/models", headers=page).status_code == 401  # from the page: it does not
        for header in ({"Authorization": f"Bearer {TOKEN}"}, {"x-api-key": TOKEN}):
            reply = httpx.get(url + "/v1/models", headers={**page, **header})
            assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == PAGE


def test_health_answers_on_its_alias(cors_app) -> None:  # type: ignore[no-untyped-def]
    url = cors_app.appliance.http_url
    alias = httpx.get(url + "/health", headers={"Origin": PAGE})
    assert alias.status_code == 200 and alias.json()["status"] == "ok"
    assert alias.headers["access-control-allow-origin"] == PAGE
    assert alias.json().keys() == httpx.get(url + "/v1/health").json().keys()

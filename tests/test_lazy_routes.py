"""Route families imported at their first request (:class:`~appliance.http.lazyroutes.LazyRoutes`): a family routes
exactly as its routes listed in the app would (matches, 405 and its ``Allow``, the trailing-slash redirect, URL
names), loads only when a request is for one of its paths, and each of the app's families answers its first
request. That a serving process never imports them is ``tests/test_serving_imports.py``'s check."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from harness import running
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, Route
from starlette.testclient import TestClient

from appliance.http.lazyroutes import LazyRoutes


async def greet(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"hello {request.path_params.get('name', 'you')}")


async def other(request: Request) -> PlainTextResponse:
    return PlainTextResponse("other")


def greeting_routes() -> list[BaseRoute]:
    return [Route("/greet", greet, methods=["GET"]),
            Route("/greet/{name}", greet, methods=["GET"], name="greet_one"),
            Route("/greet/{name}", greet, methods=["DELETE"], name="forget")]


class Loader:
    """:func:`greeting_routes`, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> list[BaseRoute]:
        self.calls += 1
        return greeting_routes()


REQUESTS = [("GET", "/other"), ("GET", "/greet"), ("HEAD", "/greet"), ("GET", "/greet/bob"), ("DELETE", "/greet/bob"),
            ("POST", "/greet"), ("POST", "/greet/bob"), ("GET", "/greet/"), ("GET", "/greet/bob/"), ("GET", "/other/"),
            ("GET", "/nothing"), ("GET", "/greeting"), ("GET", "/")]


def answer(client: TestClient, method: str, path: str) -> tuple[int, str, str | None, str | None]:
    response = client.request(method, path, follow_redirects=False)
    return response.status_code, response.text, response.headers.get("allow"), response.headers.get("location")


def test_a_lazy_family_routes_as_its_routes_listed_in_the_app() -> None:
    listed = TestClient(Starlette(routes=[Route("/other", other), *greeting_routes()]))
    lazy = TestClient(Starlette(routes=[Route("/other", other),
                                        LazyRoutes(Loader(), paths=["/greet"], prefixes=["/greet/"])]))
    for method, path in REQUESTS:
        assert answer(lazy, method, path) == answer(listed, method, path), (method, path)


def test_a_lazy_family_loads_once_at_the_first_request_for_its_paths() -> None:
    loader = Loader()
    family = LazyRoutes(loader, paths=["/greet"], prefixes=["/greet/"])
    client = TestClient(Starlette(routes=[Route("/other", other), family]))
    for path in ("/other", "/nothing", "/greeting", "/"):
        client.get(path, follow_redirects=False)
    assert loader.calls == 0 and not family.loaded
    assert client.get("/greet/ann").text == "hello ann"
    assert client.get("/greet").text == "hello you"
    assert loader.calls == 1 and family.loaded


def test_a_lazy_family_names_its_urls() -> None:
    app = Starlette(routes=[Route("/other", other), LazyRoutes(Loader(), paths=["/greet"], prefixes=["/greet/"])])
    assert app.url_path_for("forget", name="bob") == "/greet/bob"
    assert app.url_path_for("other") == "/other"


@pytest.fixture(scope="module")
def families(tiny_model: Path) -> list[tuple[LazyRoutes, list[BaseRoute]]]:
    """The shipped app's families and their routes (loaded here, in a running appliance's app)."""
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        assert app.appliance.http_server is not None
        found = [route for route in app.appliance.http_server.config.app.routes if isinstance(route, LazyRoutes)]
        return [(family, family.routes) for family in found]


def test_every_path_of_a_family_is_one_it_loads_for(families: list[tuple[LazyRoutes, list[BaseRoute]]]) -> None:
    assert len(families) == 5  # the Anthropic, embeddings, Responses, metrics and admin routes
    for family, routes in families:
        assert routes
        for route in routes:
            assert isinstance(route, Route)
            assert family.owns(route.path), route.path  # a template's parameters come after an owned prefix


def test_each_family_answers_its_first_request(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}, "embed": {"path": str(tiny_model), "embeddings": True}},
                 model_dirs=[tiny_model.parent]) as app:
        assert app.appliance.http_server is not None
        url = app.appliance.http_url
        families = [route for route in app.appliance.http_server.config.app.routes if isinstance(route, LazyRoutes)]
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        assert not any(family.loaded for family in families)  # a chat and the health document load none

        scraped = httpx.get(url + "/metrics", timeout=60)
        assert scraped.status_code == 200
        assert 'appliance_requests_total{model="tiny",outcome="ok",surface="openai"} 1.0' in scraped.text

        message = httpx.post(url + "/v1/messages", timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hello"}]})
        assert message.status_code == 200, message.text
        assert message.json()["type"] == "message"
        wrong = httpx.get(url + "/v1/messages", timeout=60)  # the family's 405, in Anthropic's error envelope
        assert wrong.status_code == 405 and wrong.json()["type"] == "error"

        response = httpx.post(url + "/v1/responses", timeout=60, json={
            "model": "tiny", "input": "Hello", "max_output_tokens": 2, "store": False})
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "response"
        missing = httpx.get(url + "/v1/responses/resp_nothing", timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND"

        vectors = httpx.post(url + "/v1/embeddings", timeout=60, json={"model": "embed", "input": "Hello"})
        assert vectors.status_code == 200, vectors.text
        assert len(vectors.json()["data"][0]["embedding"]) == 256

        page = httpx.get(url + "/admin/", timeout=60)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert httpx.get(url + "/admin/nothing", timeout=60).status_code == 404
        assert all(family.loaded for family in families)

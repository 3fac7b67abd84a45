"""Embeddings over MAGN (EMBED_REQUEST -> EMBEDDINGS): a real tiny model with ``embeddings: true``, driven by a raw
peer; the vectors are the HTTP route's; bad requests and an answer over the frame limit are ERRORs of their task,
and the connection goes on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from harness import RawPeer, Running, running

from appliance.http import embeddings_schema
from appliance.protocol import messages as m

TEXTS = ["the cat sat on the mat", "a completely different sentence about ships"]
FRAME_LIMIT = 64 * 1024  # about nine of the tiny model's 256-number vectors


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[Running]:
    models = {"embed": {"path": str(tiny_model), "embeddings": True, "n_ctx": 64}, "plain": {"path": str(tiny_model)}}
    with running(models, model_dirs=[tiny_model.parent], max_frame_bytes=FRAME_LIMIT) as running_app:
        yield running_app


@pytest.fixture
def peer(app: Running) -> Iterator[RawPeer]:
    client = RawPeer(app.socket, timeout=120)
    yield client
    client.close()


def ask(peer: RawPeer, request: m.EmbedRequest) -> m.Message:
    peer.send(request.to_payload())
    return peer.read()


def test_the_limits_are_the_http_routes() -> None:
    assert m.MAX_EMBED_INPUTS == embeddings_schema.MAX_INPUTS


def test_vectors_equal_the_http_routes(app: Running, peer: RawPeer) -> None:
    answer = ask(peer, m.EmbedRequest("e1", "embed", tuple(TEXTS)))
    assert isinstance(answer, m.Embeddings), answer
    assert answer.task_id == "e1" and answer.model == "embed"
    got = np.array(answer.data)
    assert got.shape == (2, 256)
    assert np.abs(np.linalg.norm(got, axis=1) - 1.0).max() < 1e-5
    reply = httpx.post(f"{app.appliance.http_url}/v1/embeddings", json={"model": "embed", "input": TEXTS},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    document = reply.json()
    assert np.array_equal(got, np.array([item["embedding"] for item in document["data"]]))
    assert answer.usage.prompt_tokens == document["usage"]["prompt_tokens"]


def test_a_model_without_embeddings_is_refused_naming_the_setting(peer: RawPeer) -> None:
    answer = ask(peer, m.EmbedRequest("e2", "plain", ("hello",)))
    assert isinstance(answer, m.ErrorMessage) and answer.task_id == "e2"
    assert answer.error.code == "BAD_REQUEST" and answer.error.details["setting"] == "models[].embeddings"
    assert ask(peer, m.EmbedRequest("e3", "ghost", ("hello",))).error.code == "UNKNOWN_MODEL"  # type: ignore[union-attr]


def test_an_answer_over_the_frame_limit_is_refused_and_the_connection_goes_on(peer: RawPeer) -> None:
    many = tuple(f"sentence number {index} about cats" for index in range(16))
    answer = ask(peer, m.EmbedRequest("e4", "embed", many))
    assert isinstance(answer, m.ErrorMessage) and answer.task_id == "e4"
    assert answer.error.code == "FRAME_TOO_LARGE"
    details = answer.error.details
    assert details["max_frame_bytes"] == FRAME_LIMIT and details["length"] > FRAME_LIMIT and details["inputs"] == 16
    fitting = ask(peer, m.EmbedRequest("e5", "embed", many[:2]))
    assert isinstance(fitting, m.Embeddings) and len(fitting.data) == 2


def test_a_malformed_request_is_a_bad_payload_of_its_task(peer: RawPeer) -> None:
    peer.send({"type": "EMBED_REQUEST", "task_id": "e6", "model": "embed", "input": []})
    refusal = peer.read()
    assert isinstance(refusal, m.ErrorMessage) and refusal.task_id == "e6"
    assert refusal.error.code == "BAD_PAYLOAD" and refusal.error.details["field"] == "input"
    assert isinstance(ask(peer, m.EmbedRequest("e7", "embed", ("hello",))), m.Embeddings)

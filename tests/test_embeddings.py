"""``POST /v1/embeddings`` (models[].embeddings): the pure checks and packing, then a real tiny model through the
appliance (vectors, batching, encodings, the official client, the ledger's key, the refusals)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from harness import Running, running

from appliance.daemon.core import embedding_key
from appliance.engine import embedding
from appliance.errors import ApplianceError
from appliance.http import embeddings_schema as schema

DIM = 256  # tests/conftest.py's tiny_model is 256 wide
TEXTS = ["the cat sat on the mat", "a completely different sentence about ships", "the cat sat on the mat",
         "one more"]


# -- pure ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": ["ok", ""]}, "input[1]"),
    ({"model": "m", "input": ["ok", 3]}, "input[1]"),
    ({"model": "m", "input": [[1, 2], []]}, "input[1]"),
    ({"model": "m", "input": [[1, -2]]}, "input[0]"),
    ({"model": "m", "input": [True]}, "input[0]"),
    ({"model": "m", "input": ["x"] * (schema.MAX_INPUTS + 1)}, "input"),
    ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "x", "user": 5}, "user"),
    ({"model": "m", "input": "x", "truncate": True}, "truncate"),
])
def test_bad_request_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        schema.embeddings_request(body)
    assert caught.value.code == "BAD_REQUEST"
    assert caught.value.details["param"] == param


@pytest.mark.parametrize(("value", "expected"), [
    ("one", ("one",)),
    (["a", "b"], ("a", "b")),
    ([5, 6, 7], ((5, 6, 7),)),
    ([[5], [6, 7]], ((5,), (6, 7))),
    (["a", [6, 7]], ("a", (6, 7))),
])
def test_input_shapes(value: Any, expected: tuple[Any, ...]) -> None:
    request = schema.embeddings_request({"model": "m", "input": value, "encoding_format": "base64"})
    assert request.inputs == expected
    assert request.encoding_format == "base64"


@pytest.mark.parametrize(("lengths", "max_tokens", "max_sequences", "groups"), [
    ([3, 3, 3], 10, 8, [[0, 1, 2]]),
    ([4, 4, 4], 10, 8, [[0, 1], [2]]),
    ([10, 1, 10], 10, 8, [[0], [1], [2]]),
    ([1, 1, 1, 1, 1], 100, 2, [[0, 1], [2, 3], [4]]),
])
def test_pack(lengths: list[int], max_tokens: int, max_sequences: int, groups: list[list[int]]) -> None:
    assert embedding.pack(lengths, max_tokens, max_sequences) == groups


def test_input_checks() -> None:
    with pytest.raises(ApplianceError) as caught:
        embedding.check_inputs([[1, 2], [1] * 11], 10, 100)
    assert (caught.value.code, caught.value.details["index"], caught.value.details["tokens"]) == (
        "CONTEXT_OVERFLOW", 1, 11)
    with pytest.raises(ApplianceError) as caught:
        embedding.check_inputs([[1, 100]], 10, 100)
    assert (caught.value.code, caught.value.details["token"]) == ("BAD_REQUEST", 100)
    with pytest.raises(ApplianceError) as caught:
        embedding.check_dimensions(128, DIM)
    assert (caught.value.details["param"], caught.value.details["dimensions"]) == ("dimensions", DIM)
    embedding.check_dimensions(DIM, DIM)
    embedding.check_dimensions(None, DIM)


@pytest.mark.parametrize(("value", "pooling"), [
    (None, embedding.POOLING_MEAN), ("0", embedding.POOLING_MEAN), ("1", embedding.POOLING_MEAN),
    ("2", embedding.POOLING_CLS), ("3", embedding.POOLING_LAST),
])
def test_pooling_from_the_gguf(value: str | None, pooling: int) -> None:
    assert embedding.pooling_of(value) == pooling


def test_rank_pooling_is_refused() -> None:
    with pytest.raises(ApplianceError) as caught:
        embedding.pooling_of("4")
    assert "reranker" in caught.value.message


def test_normalised_and_base64() -> None:
    vector = embedding.normalised(np.array([3.0, 4.0]))
    assert vector.tolist() == pytest.approx([0.6, 0.8])
    raw = base64.b64decode(schema.encoded(vector, "base64"))
    assert np.frombuffer(raw, dtype="<f4").tolist() == schema.encoded(vector, "float")
    with pytest.raises(ApplianceError):
        embedding.normalised(np.zeros(4))


# -- a real model --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[Running]:
    models = {"embed": {"path": str(tiny_model), "embeddings": True, "n_ctx": 64},
              "plain": {"path": str(tiny_model)}}
    with running(models, model_dirs=[tiny_model.parent]) as running_app:
        yield running_app


def post(app: Running, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{app.appliance.http_url}/v1/embeddings", json=body, timeout=60)


def vectors(app: Running, inputs: Any, **extra: Any) -> tuple[np.ndarray, dict[str, Any]]:
    response = post(app, {"model": "embed", "input": inputs, **extra})
    assert response.status_code == 200, response.text
    document = response.json()
    assert [item["index"] for item in document["data"]] == list(range(len(document["data"])))
    return np.array([item["embedding"] for item in document["data"]], dtype=np.float64), document


def test_vectors_are_unit_deterministic_and_batched_like_one_by_one(app: Running) -> None:
    batch, document = vectors(app, TEXTS)
    assert batch.shape == (len(TEXTS), DIM)
    assert np.abs(np.linalg.norm(batch, axis=1) - 1.0).max() < 1e-5
    assert np.abs(batch[0] - batch[2]).max() == 0.0  # the same text twice in one batch
    assert np.abs(batch[0] - batch[1]).max() > 1e-3  # different texts differ
    again, _ = vectors(app, TEXTS)
    assert np.array_equal(batch, again)
    alone = np.array([vectors(app, text)[0][0] for text in TEXTS])
    assert np.abs(batch - alone).max() < 1e-4
    usage = document["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > len(TEXTS)
    assert document["object"] == "list" and document["model"] == "embed"


def test_token_ids_equal_their_text(app: Running) -> None:
    runtime = app.daemon.models["embed"].runtime
    tokens = app.call(app.daemon.engine.call(runtime.tokenize, TEXTS[1], bos=True))
    from_text, _ = vectors(app, TEXTS[1])
    from_ids, document = vectors(app, [tokens])
    assert np.abs(from_text - from_ids).max() < 1e-6
    assert document["usage"]["prompt_tokens"] == len(tokens)


def test_base64_decodes_to_the_same_floats(app: Running) -> None:
    floats, _ = vectors(app, TEXTS[:2])
    response = post(app, {"model": "embed", "input": TEXTS[:2], "encoding_format": "base64"})
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in response.json()["data"]]
    assert np.array_equal(np.array(decoded, dtype=np.float64), floats)


def test_the_official_client(app: Running) -> None:
    client = openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=60)
    answer = client.embeddings.create(model="embed", input=TEXTS[:2])  # the client asks for base64 and decodes it
    floats, _ = vectors(app, TEXTS[:2])
    got = np.array([item.embedding for item in answer.data])
    assert got.shape == (2, DIM)
    assert np.abs(got - floats).max() < 1e-6
    assert answer.usage.prompt_tokens > 0
    plain = client.embeddings.create(model="embed", input="hello", encoding_format="float", dimensions=DIM)
    assert len(plain.data[0].embedding) == DIM


def test_the_ledger_counts_the_embeddings_context_while_loaded(app: Running) -> None:
    vectors(app, "hello")
    held = app.daemon.ledger.reservations()
    assert held.get(embedding_key("embed"), 0) > 0
    unloaded = app.call(app.daemon.unload(app.daemon.models["embed"]))
    assert unloaded
    assert embedding_key("embed") not in app.daemon.ledger.reservations()
    vectors(app, "hello")  # loaded again, with a new embeddings context
    assert app.daemon.ledger.reservations().get(embedding_key("embed"), 0) > 0


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"model": "plain", "input": "hi"}, 400, "BAD_REQUEST", "model"),
    ({"model": "embed", "input": "word " * 80}, 400, "CONTEXT_OVERFLOW", "input"),
    ({"model": "embed", "input": [[1, 10**9]]}, 400, "BAD_REQUEST", "input"),
    ({"model": "embed", "input": "hi", "dimensions": 64}, 400, "BAD_REQUEST", "dimensions"),
    ({"model": "nope", "input": "hi"}, 404, "UNKNOWN_MODEL", None),
])
def test_refusals(app: Running, body: dict[str, Any], status: int, code: str, param: str | None) -> None:
    response = post(app, body)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (status, code), response.text
    if param is not None:
        assert error["param"] == param
    if body["model"] == "plain":
        assert "models[].embeddings" in error["message"]
    assert post(app, {"model": "embed", "input": "still serving"}).status_code == 200

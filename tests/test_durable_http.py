"""Durable agents over HTTP on a real chat model (Qwen's vocabulary and template), across a stop and a start on the
same state folder: an OpenAI ``user`` agent's next turn restores its KV state from disk and evaluates only the new
turn; a stored Responses chain is still retrievable and continues; the health and metrics say where state came from;
a deleted response stays deleted."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from harness import running
from prometheus_client.parser import text_string_to_metric_families
from test_real_vocab import CASES

NAME = "qwen2.5"
ALICE = f"alice@{NAME}"
"""The agent of the OpenAI ``user`` alice on the model."""


@pytest.fixture(scope="module")
def model(chat_model: Callable[..., Path]) -> Path:
    case = CASES[NAME]
    return chat_model(case.vocab, case.template, case.special_tokens)


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dh-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def box(model: Path, state: Path):  # type: ignore[no-untyped-def]
    return running({NAME: {"path": str(model), "n_ctx": 2048}}, model_dirs=[model.parent], state=state,
                   shutdown_grace_s=30)


def client_of(app) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def test_an_openai_user_agent_and_a_stored_responses_chain_survive_a_restart(model: Path, state: Path) -> None:
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}]
    with box(model, state) as app:
        client = client_of(app)
        first = client.chat.completions.create(model=NAME, messages=history, user="alice", max_tokens=6,
                                               temperature=0)
        assert first.usage.model_extra["kv_restored_from"] == "none"
        history.append({"role": "assistant", "content": first.choices[0].message.content})
        history.append({"role": "user", "content": "And then?"})
        chained = client.responses.create(model=NAME, input="Hi", instructions="Be terse.", max_output_tokens=5,
                                          temperature=0)
        deleted = client.responses.create(model=NAME, input="Bye", max_output_tokens=3, temperature=0)
        client.responses.delete(deleted.id)
        reference = client.chat.completions.create(model=NAME, messages=history, max_tokens=6, temperature=0)
        held = len(app.daemon.agents[ALICE].conversation.tokens)
    with box(model, state) as app:
        client = client_of(app)
        assert app.daemon.agents[ALICE].dormant  # back, holding no model until its first turn
        row = agent_row(httpx.get(f"{app.appliance.http_url}/admin/_dashboard", timeout=30).text, ALICE)
        assert "on disk" in row and "dormant: its model loads at its next turn" in row
        second = client.chat.completions.create(model=NAME, messages=history, user="alice", max_tokens=6,
                                                temperature=0)
        usage = second.usage
        assert usage.model_extra["kv_restored_from"] == "disk"
        assert usage.prompt_tokens_details.cached_tokens >= held - 1  # only the new turn is evaluated
        assert second.choices[0].message.content == reference.choices[0].message.content

        fetched = client.responses.retrieve(chained.id)
        assert fetched.output_text == chained.output_text
        follow = client.responses.create(model=NAME, input="More?", instructions="Be terse.",
                                         previous_response_id=chained.id, max_output_tokens=4, temperature=0)
        assert follow.usage.input_tokens_details.cached_tokens >= chained.usage.input_tokens
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(deleted.id)

        health = httpx.get(f"{app.appliance.http_url}/v1/health", timeout=30).json()
        assert health["status"] == "ok"
        assert health["kv_restored_from"]["disk"] >= 2
        assert health["store"]["status"] == "ok" and health["disk_kv"]["status"] == "ok"
        text = httpx.get(f"{app.appliance.http_url}/metrics", timeout=30).text
        restored = {sample.labels["tier"]: sample.value for family in text_string_to_metric_families(text)
                    if family.name == "appliance_kv_restored_from" for sample in family.samples
                    if sample.name.endswith("_total")}
        assert restored["disk"] >= 2
        row = agent_row(httpx.get(f"{app.appliance.http_url}/admin/_dashboard", timeout=30).text, ALICE)
        assert '<td class="restored">disk</td>' in row


def agent_row(html: str, agent: str) -> str:
    """The admin dashboard's agents-table row of ``agent``."""
    start = html.index(f'<tr data-agent="{agent}">')
    return html[start:html.index("</tr>", start)]

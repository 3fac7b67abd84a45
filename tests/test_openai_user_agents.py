"""An OpenAI ``user`` names an end user, not a model (issue #26, "Agents over HTTP"), against a real appliance with
two real tiny models and the official ``openai`` client:

* the same ``user`` on two models is two conversations, ``<user>@<model>``, and each continues its own (before, the
  second model was a 400);
* such an agent lets its model go: once the model has been idle for its own ``idle_ttl_s`` the agent goes dormant
  (its KV state written to disk) and the model unloads, while a line-protocol agent keeps its model loaded; the
  agent stays registered, and its next turn loads the model again and continues where it stopped, its state read
  back from disk."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from harness import Running, running

WAIT_S = 60.0  # a bound for a slow, shared 2-core box
STORY = ("Once upon a time in a small village by the sea there lived an old fisherman who every morning went out "
         "in his little boat to catch fish for the market")


@pytest.fixture
def app(tiny_model: Path, tiny_model_b: Path) -> Iterator[Running]:
    models = {"tiny": {"path": str(tiny_model), "idle_ttl_s": 1}, "tiny_b": {"path": str(tiny_model_b),
                                                                            "idle_ttl_s": 1}}
    with running(models, model_dirs=[tiny_model.parent, tiny_model_b.parent], agent_idle_ttl_s=3600,
                 disk_kv_budget="64MiB") as running_app:
        yield running_app


def client_of(app: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=120)


def turn(client: openai.OpenAI, model: str, history: list[dict[str, str]]) -> openai.types.chat.ChatCompletion:
    """One greedy turn of ``history`` as the user ``ada``; the reply and the next user turn are added to it."""
    reply = client.chat.completions.create(model=model, messages=history, max_tokens=6, temperature=0, user="ada")
    history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                {"role": "user", "content": "And then?"}]
    return reply


def wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_S:.0f} s for {what}"
        time.sleep(0.05)


def test_the_same_user_on_two_models_has_two_conversations(app: Running) -> None:
    client = client_of(app)
    on_tiny = [{"role": "user", "content": STORY}]
    on_b = [{"role": "user", "content": "A different opening about a mountain"}]
    first_tiny = turn(client, "tiny", on_tiny)
    first_b = turn(client, "tiny_b", on_b)  # was a 400: the agent was on tiny
    agents = app.daemon.agents
    assert agents["ada@tiny"].model.key == "tiny" and agents["ada@tiny_b"].model.key == "tiny_b"
    assert "ada" not in agents

    second_tiny = turn(client, "tiny", on_tiny)
    second_b = turn(client, "tiny_b", on_b)
    for first, second in ((first_tiny, second_tiny), (first_b, second_b)):
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 1  # each continued its own conversation, not the other's
        assert second.usage.prompt_tokens - cached < first.usage.prompt_tokens
    assert len(agents["ada@tiny"].conversation.tokens) == (second_tiny.usage.prompt_tokens
                                                            + second_tiny.usage.completion_tokens)
    assert len(agents["ada@tiny_b"].conversation.tokens) == (second_b.usage.prompt_tokens
                                                              + second_b.usage.completion_tokens)
    recent = {record.agent for record in app.daemon.requests.recent(4)}
    assert recent == {"ada@tiny", "ada@tiny_b"}

    # A header names the agent itself: the user's agent on tiny answers to its id on every surface.
    named = client.chat.completions.create(model="tiny", messages=on_tiny, max_tokens=2, temperature=0,
                                           extra_headers={"X-Agent-Id": "ada@tiny"})
    assert named.usage.prompt_tokens_details.cached_tokens >= second_tiny.usage.prompt_tokens - 1
    assert app.line("UNREGISTER ada@tiny_b").startswith("OK")


def test_an_idle_users_agent_lets_its_model_unload_and_its_next_turn_continues(app: Running) -> None:
    client = client_of(app)
    assert app.line("REGISTER keeper tiny_b").startswith("OK")  # a line-protocol agent holds its model
    assert app.line("DECODE keeper 2 Hello").startswith("OK")
    history = [{"role": "user", "content": STORY}]
    first = turn(client, "tiny", history)
    reference = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, temperature=0)
    agent = app.daemon.agents["ada@tiny"]
    held = len(agent.conversation.tokens)

    wait_for(lambda: app.daemon.model_state("tiny") == "available", "tiny to unload after its idle TTL")
    assert agent.dormant and app.daemon.agents.get("ada@tiny") is agent  # still registered, holding no model
    assert agent.conversation.where == "disk" and agent.conversation.tokens  # its KV state written out
    assert app.daemon.models["tiny"].refcount == 0
    assert app.daemon.model_state("tiny_b") == "loaded"  # idle as long, but its line agent keeps it
    [record] = [line for line in app.line("STATUS").splitlines() if line.startswith("agent id=ada@tiny ")]
    assert "dormant=true" in record

    second = turn(client, "tiny", history)  # loads tiny again and continues where it stopped
    usage = second.usage
    assert usage.model_extra["kv_restored_from"] == "disk"
    assert usage.prompt_tokens_details.cached_tokens >= held - 1  # only the new turn is evaluated
    assert second.choices[0].message.content == reference.choices[0].message.content
    assert not agent.dormant and app.daemon.model_state("tiny") == "loaded"
    assert app.daemon.models["tiny"].refcount == 1
    assert first.usage.prompt_tokens < usage.prompt_tokens

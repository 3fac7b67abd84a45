"""Reasoning (``<think>…</think>``) split out of the answer: the pure splitter on the vendored Qwen3 and DeepSeek R1
templates' real prompts, and the OpenAI chat surface (``message.reasoning_content``, streamed
``delta.reasoning_content``, ``models[].reasoning: inline``) with the fake engine writing the reply."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from harness import Running, running

from appliance.config.validate import Config
from appliance.engine import reasoning
from appliance.engine.chat import Message, read_chat_template, render_prompt
from appliance.engine.fake import FakeEngine
from appliance.engine.interface import Sampling

R1_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
MARKERS = reasoning.Markers()


@pytest.fixture(scope="module")
def qwen3(chat_model: Any) -> Path:
    return chat_model("qwen2", "Qwen-Qwen3-0.6B")


@pytest.fixture(scope="module")
def r1(chat_model: Any) -> Path:
    return chat_model("llama-bpe", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", R1_TOKENS)


@pytest.fixture(scope="module")
def r1_qwen(chat_model: Any) -> Path:
    """Its generation prompt closes the reasoning unless ``enable_thinking`` is set (the appliance sets none)."""
    return chat_model("qwen2", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", R1_TOKENS)


def prompt_text(path: Path) -> str:
    return render_prompt(read_chat_template(path), [Message("user", "Why is the sky blue?")]).text


# -- pure ----------------------------------------------------------------------------------------------------------


def test_templates_are_detected(qwen3: Path, r1: Path, chat_model: Any) -> None:
    assert reasoning.detect(read_chat_template(qwen3).source) == MARKERS
    assert reasoning.detect(read_chat_template(r1).source) == MARKERS
    plain = chat_model("qwen2", "Qwen-Qwen2.5-7B-Instruct")
    assert reasoning.detect(read_chat_template(plain).source) is None


def test_r1_starts_inside_and_the_others_do_not(qwen3: Path, r1: Path, r1_qwen: Path) -> None:
    r1_prompt = prompt_text(r1)
    assert r1_prompt.endswith("<think>\n")
    assert reasoning.starts_inside(r1_prompt, MARKERS)
    assert not reasoning.starts_inside(prompt_text(qwen3), MARKERS)
    closed = prompt_text(r1_qwen)
    assert closed.endswith("<think>\n</think>")
    assert not reasoning.starts_inside(closed, MARKERS)


SPLITS = [  # (reply, starts inside, reasoning, content)
    ("<think>\nRayleigh scattering.\n</think>\n\nBecause of scattering.", False, "Rayleigh scattering.",
     "Because of scattering."),
    ("Rayleigh scattering.\n</think>\n\nBecause of scattering.", True, "Rayleigh scattering.",
     "Because of scattering."),
    ("Because of scattering.", False, None, "Because of scattering."),
    ("  Hi <think> in the middle", False, None, "  Hi <think> in the middle"),
    ("<think>\n\n</think>\n\nHi", False, None, "Hi"),
    ("<think>\nstill thinking when max_tokens ran out", False, "still thinking when max_tokens ran out", ""),
    ("only thoughts", True, "only thoughts", ""),
    ("a </thin b\n</think>c", True, "a </thin b", "c"),
    ("<thi", False, None, "<thi"),
    ("line one\n\nline two\n</think>\n", True, "line one\n\nline two", ""),
]


@pytest.mark.parametrize(("reply", "inside", "thought", "content"), SPLITS)
def test_split(reply: str, inside: bool, thought: str | None, content: str) -> None:
    assert reasoning.split(reply, MARKERS, inside=inside) == reasoning.Split(thought, content)


@pytest.mark.parametrize(("reply", "inside", "thought", "content"), SPLITS)
def test_streamed_in_any_pieces_equals_the_split(reply: str, inside: bool, thought: str | None, content: str) -> None:
    for size in range(1, len(reply) + 1):
        splitter = reasoning.StreamSplitter(MARKERS, inside=inside)
        events: list[reasoning.Event] = []
        for at in range(0, len(reply), size):
            events.extend(splitter.feed(reply[at:at + size]))
        events.extend(splitter.finish())
        assert all(event.text for event in events)
        said = "".join(e.text for e in events if isinstance(e, reasoning.Reasoning)) or None
        answered = "".join(e.text for e in events if isinstance(e, reasoning.Content))
        assert (said, answered) == (thought, content), f"pieces of {size}"


# -- the OpenAI chat surface ---------------------------------------------------------------------------------------

R1_REPLY = "The sky scatters blue light more.\n</think>\n\nRayleigh scattering."
QWEN3_REPLY = "<think>\nShort wavelengths scatter.\n</think>\n\nRayleigh scattering."


@pytest.fixture(scope="module")
def app(qwen3: Path, r1: Path) -> Iterator[Running]:
    engines: list[FakeEngine] = []

    def fake(config: Config) -> FakeEngine:
        engine = FakeEngine()
        engines.append(engine)
        return engine

    models = {"r1": {"path": str(r1)}, "qwen3": {"path": str(qwen3)},
              "r1-inline": {"path": str(r1), "reasoning": "inline"}}
    with running(models, model_dirs=[r1.parent], engine_factory=fake) as running_app:
        yield running_app


def reply_with(app: Running, text: str) -> None:
    def script(sampling: Sampling) -> str:
        return text

    app.engine.script = script


@pytest.fixture
def client(app: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.appliance.http_url}/v1", api_key="none", max_retries=0, timeout=60)


def ask(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Why is the sky blue?"}],
                                          max_tokens=200, **extra)


@pytest.mark.parametrize(("model", "reply", "thought"), [
    ("r1", R1_REPLY, "The sky scatters blue light more."),
    ("qwen3", QWEN3_REPLY, "Short wavelengths scatter."),
])
def test_plain_answer_has_reasoning_content(app: Running, client: openai.OpenAI, model: str, reply: str,
                                            thought: str) -> None:
    reply_with(app, reply)
    message = ask(client, model).choices[0].message
    assert message.content == "Rayleigh scattering."
    assert message.model_extra["reasoning_content"] == thought


@pytest.mark.parametrize(("model", "reply", "thought"), [
    ("r1", R1_REPLY, "The sky scatters blue light more."),
    ("qwen3", QWEN3_REPLY, "Short wavelengths scatter."),
])
def test_stream_has_reasoning_deltas(app: Running, client: openai.OpenAI, model: str, reply: str,
                                     thought: str) -> None:
    reply_with(app, reply)
    said = []
    answered = []
    for chunk in ask(client, model, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert not (extra.get("reasoning_content") and delta.content)  # one kind per chunk
        said.append(extra.get("reasoning_content") or "")
        answered.append(delta.content or "")
    assert "".join(said) == thought
    assert "".join(answered) == "Rayleigh scattering."


def test_inline_keeps_the_text(app: Running, client: openai.OpenAI) -> None:
    reply_with(app, R1_REPLY)
    message = ask(client, "r1-inline").choices[0].message
    assert message.content == R1_REPLY
    assert "reasoning_content" not in (message.model_extra or {})
    body = {"model": "r1-inline", "stream": True, "max_tokens": 200,
            "messages": [{"role": "user", "content": "Why?"}]}
    with httpx.stream("POST", f"{app.appliance.http_url}/v1/chat/completions", json=body, timeout=60) as response:
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(event)["choices"][0]["delta"] for event in events if json.loads(event)["choices"]]
    assert "".join(delta.get("content") or "" for delta in deltas) == R1_REPLY
    assert not any("reasoning_content" in delta for delta in deltas)


def test_a_reply_without_reasoning_is_all_content(app: Running, client: openai.OpenAI) -> None:
    reply_with(app, "Just the answer.")
    message = ask(client, "qwen3").choices[0].message
    assert message.content == "Just the answer."
    assert "reasoning_content" not in (message.model_extra or {})

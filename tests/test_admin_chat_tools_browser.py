"""The admin chat box with tools, in a real headless Chromium (as tests/test_admin_browser.py) against a real
appliance serving a model with Qwen2.5's real tokenizer and chat template (random weights: the grammar makes the
call valid): the tools box's JSON goes as ``tools`` with the chosen ``tool_choice``, a reply that calls a tool is
shown as the call (the function's name and its pretty-printed arguments in a block of their own, never the raw
markup), and the call goes back in the history of the next turn. Model output is inserted as text only."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from harness import Running, running
from test_admin_browser import DESKTOP, Problems

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
WAIT_MS = 90_000  # a generation on a slow, shared 2-core machine
SENT = """() => {
    window.sentBodies = [];
    const original = window.fetch;
    window.fetch = (url, options) => {
        if (String(url).endsWith("/v1/chat/completions")) {
            window.sentBodies.push(JSON.parse(options.body));
        }
        return original(url, options);
    };
}"""
"""Records the body of every chat request the page sends."""


@pytest.fixture(scope="module")
def app(chat_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    folder = tmp_path_factory.mktemp("chat-tools")
    shutil.copy(chat_model("qwen2", "Qwen-Qwen2.5-7B-Instruct"), folder / "qwen.gguf")
    with running({"qwen": {"path": str(folder / "qwen.gguf"), "n_ctx": 1024}}, model_dirs=[folder]) as running_app:
        yield running_app


@pytest.fixture
def page(app: Running, browser: Any) -> Iterator[tuple[Any, Problems]]:
    problems = Problems()
    context = browser.new_context(viewport=DESKTOP)
    try:
        chat = problems.watch(context.new_page())
        chat.goto(app.appliance.http_url + "/admin/chat")
        chat.evaluate(SENT)
        chat.select_option("#chat-model", "qwen")
        chat.fill("#chat-max-tokens", "96")
        chat.fill("#chat-temperature", "0")
        chat.click("#chat-tools-box summary")
        chat.uncheck("#chat-parallel")  # one call: random weights would call on until max_tokens
        yield chat, problems
    finally:
        problems.stop()
        context.close()
    assert problems.seen == []


def send(chat: Any, message: str) -> str:
    """Send ``message`` and wait for the reply's end; the status text."""
    before = chat.locator(".message-assistant").count()
    chat.fill("#chat-message", message)
    chat.click("#chat-send")
    chat.locator(f'.message-assistant >> nth={before}').wait_for(timeout=WAIT_MS)
    chat.locator('#chat-status[data-state="done"], #chat-status[data-state="error"]').wait_for(timeout=WAIT_MS)
    chat.wait_for_function("document.getElementById('chat-send').disabled === false", timeout=WAIT_MS)
    return str(chat.inner_text("#chat-status"))


def test_a_required_tool_call_is_shown_as_a_call(page: tuple[Any, Problems]) -> None:
    chat, _ = page
    chat.fill("#chat-tools", json.dumps(TOOLS))
    chat.select_option("#chat-tool-choice", "required")
    status = send(chat, "What is the weather in Paris?")
    assert chat.get_attribute("#chat-status", "data-state") == "done", status
    assert "(tool_calls)" in status and "1 tool call" in status
    body = chat.evaluate("window.sentBodies")[0]
    assert body["tools"] == TOOLS and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False

    reply = chat.locator(".message-assistant").last
    assert reply.get_attribute("data-tool-calls") == "1"
    block = reply.locator(".tool-call")
    assert block.count() == 1
    name = block.locator(".tool-name").inner_text()
    assert name in SCHEMAS
    shown = block.locator(".tool-arguments").inner_text()
    arguments = json.loads(shown)
    jsonschema.validate(arguments, SCHEMAS[name])
    assert shown == json.dumps(arguments, indent=2, ensure_ascii=False)  # pretty-printed
    assert block.locator(".tool-arguments *").count() == 0  # text, not markup
    assert "<tool_call>" not in reply.inner_text()  # the call, not the model's raw text

    chat.select_option("#chat-tool-choice", "none")
    status = send(chat, "Thanks.")
    assert chat.get_attribute("#chat-status", "data-state") == "done", status
    history = chat.evaluate("window.sentBodies")[1]["messages"]
    assert [message["role"] for message in history] == ["user", "assistant", "user"]
    call = history[1]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == name and json.loads(call["function"]["arguments"]) == arguments
    assert chat.locator(".message-assistant").last.locator(".tool-call").count() == 0


def test_a_named_function_is_offered_and_called(page: tuple[Any, Problems]) -> None:
    chat, _ = page
    chat.fill("#chat-tools", json.dumps(TOOLS))
    offered = chat.locator("#chat-tool-choice option").all_inner_texts()
    assert offered[3:] == ["call get_weather", "call get_time"]
    chat.select_option("#chat-tool-choice", "function:get_time")
    status = send(chat, "What time is it in Tokyo?")
    assert chat.get_attribute("#chat-status", "data-state") == "done", status
    assert chat.evaluate("window.sentBodies")[0]["tool_choice"] == {"type": "function",
                                                                    "function": {"name": "get_time"}}
    block = chat.locator(".message-assistant .tool-call")
    assert block.locator(".tool-name").inner_text() == "get_time"
    jsonschema.validate(json.loads(block.locator(".tool-arguments").inner_text()), CLOCK)


def test_tools_that_are_not_a_json_array_are_refused_before_sending(page: tuple[Any, Problems]) -> None:
    chat, _ = page
    for text, said in (("[{", "tools: not JSON"), ('{"type": "function"}', "tools: must be a JSON array")):
        chat.fill("#chat-tools", text)
        chat.fill("#chat-message", "hi")
        chat.click("#chat-send")
        chat.locator('#chat-status[data-state="error"]').wait_for(timeout=WAIT_MS)
        assert said in chat.inner_text("#chat-status")
    assert chat.evaluate("window.sentBodies") == []
    assert chat.locator(".message").count() == 0
    assert chat.locator("#chat-tool-choice option").count() == 3  # no function to offer

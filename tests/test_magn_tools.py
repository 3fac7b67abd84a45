"""Tool calls and chat templates on the socket surfaces: a MAGN session started with tools (TASK_START ``tools``)
has its chat INFER_REQUESTs rendered with them in the model's own template, its output constrained to a call of
one of them (``tool_choice``) and parsed into TASK_COMPLETE's ``tool_call``; a line-protocol DECODE prompt stays
raw text. Real appliance, real tokenizer and template (Qwen2.5's, on random weights: the grammar, not the weights,
makes the call valid)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llama_cpp
import pytest
from harness import RawPeer, Running, running

from appliance.daemon.core import DecodeResult
from appliance.engine import toolcalls
from appliance.engine.chat import Message, read_chat_template, render_prompt
from appliance.engine.interface import Generation
from appliance.protocol import lines
from appliance.protocol import messages as m
from appliance.server.magn import completion, sampling_of

QWEN = ("qwen2", "Qwen-Qwen2.5-7B-Instruct")
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
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def app(chat_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    folder = tmp_path_factory.mktemp("magn-tools")
    shutil.copy(chat_model(*QWEN), folder / "qwen.gguf")
    with running({"qwen": {"path": str(folder / "qwen.gguf"), "n_ctx": 1024}}, model_dirs=[folder],
                 http=False) as running_app:
        yield running_app


@pytest.fixture
def peer(app: Running) -> Iterator[RawPeer]:
    client = RawPeer(app.socket, timeout=120)
    yield client
    client.close()


def start(peer: RawPeer, session: str, tools: Any = TOOLS) -> m.Message:
    peer.send({"type": "TASK_START", "task_id": f"start-{session}", "session_id": session, "model": "qwen",
               "tools": tools})
    return peer.read_token()


def infer(peer: RawPeer, task_id: str, **fields: Any) -> list[m.Message]:
    peer.send({"type": "INFER_REQUEST", "task_id": task_id, "max_tokens": 96, "temperature": 0, **fields})
    return peer.read_until_end(task_id)


def check_call(call: m.ToolCall | None, name: str | None = None) -> m.ToolCall:
    assert call is not None
    assert call.name in SCHEMAS if name is None else call.name == name
    jsonschema.validate(call.arguments, SCHEMAS[call.name])
    assert call.id  # a new one: "call_..." (9 letters or digits for the Mistral formats)
    return call


def test_a_session_with_tools_and_tool_choice_required_gets_a_schema_valid_call(peer: RawPeer) -> None:
    started = start(peer, "caller")
    assert isinstance(started, m.TaskStart) and started.status == "started"
    done = infer(peer, "ask", session_id="caller", messages=ASK, tool_choice="required")[-1]
    assert isinstance(done, m.TaskComplete), done
    assert done.stop_reason == "tool_call", done
    assert check_call(done.tool_call).id.startswith("call_")
    assert "<tool_call>" not in done.text and done.stats["tool_format"] == "hermes"


FORMATS = {"llama3.1": "llama3", "hermes3": "hermes", "mistral-nemo": "mistral", "plain": "generic"}
"""Other templates (tests/test_real_vocab.py's cases) and the call format each has; ``plain``: the tiny model,
without a template."""


@pytest.mark.parametrize("case", sorted(FORMATS))
def test_each_call_format_gives_a_schema_valid_call(case: str, chat_model: Callable[..., Path], tiny_model: Path,
                                                    tmp_path: Path) -> None:
    from test_real_vocab import CASES

    source = tiny_model if case == "plain" else chat_model(CASES[case].vocab, CASES[case].template,
                                                           CASES[case].special_tokens)
    shutil.copy(source, tmp_path / "model.gguf")
    with running({"model": {"path": str(tmp_path / "model.gguf"), "n_ctx": 1024}}, model_dirs=[tmp_path],
                 http=False) as other:
        client = RawPeer(other.socket, timeout=120)
        try:
            client.send({"type": "TASK_START", "task_id": "start", "session_id": "agent", "model": "model",
                         "tools": TOOLS})
            assert isinstance(client.read_token(), m.TaskStart)
            done = infer(client, "ask", session_id="agent", messages=ASK, tool_choice="required")[-1]
        finally:
            client.close()
    assert isinstance(done, m.TaskComplete) and done.stop_reason == "tool_call", done
    check_call(done.tool_call)
    assert done.stats["tool_format"] == FORMATS[case]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_named_function_is_the_one_called(peer: RawPeer, name: str) -> None:
    start(peer, f"named-{name}")
    choice = {"type": "function", "function": {"name": name}}
    for seed in (1, 2):
        done = infer(peer, f"ask-{seed}", session_id=f"named-{name}", messages=ASK, tool_choice=choice,
                     temperature=1.0, seed=seed)[-1]
        assert isinstance(done, m.TaskComplete) and done.stop_reason == "tool_call", done
        check_call(done.tool_call, name)


def test_a_streamed_call_streams_the_raw_output_with_logprobs(peer: RawPeer) -> None:
    start(peer, "streamer")
    got = infer(peer, "ask", session_id="streamer", messages=ASK, tool_choice="required", stream=True,
                logprobs=True)
    tokens = [message for message in got if isinstance(message, m.StreamToken)]
    done = got[-1]
    assert isinstance(done, m.TaskComplete) and done.stop_reason == "tool_call", done
    call = check_call(done.tool_call)
    raw = "".join(token.text for token in tokens)
    assert raw.lstrip().startswith("<tool_call>") and call.name in raw
    assert tokens and all(token.logprob is not None and token.logprob <= 0 for token in tokens)
    assert done.usage.completion_tokens - len(tokens) in (0, 1)  # the end-of-turn token is counted, not streamed


def test_the_call_and_its_result_go_back_in_the_history(peer: RawPeer) -> None:
    start(peer, "looper")
    first = infer(peer, "ask", session_id="looper", messages=ASK, tool_choice="required")[-1]
    assert isinstance(first, m.TaskComplete) and first.tool_call is not None, first
    call = {"name": first.tool_call.name, "arguments": first.tool_call.arguments, "id": first.tool_call.id}
    history = [*ASK, {"role": "assistant", "content": first.text, "tool_calls": [call]},
               {"role": "tool", "content": "Sunny, 21 degrees", "tool_call_id": first.tool_call.id}]
    second = infer(peer, "answer", session_id="looper", messages=history, max_tokens=8)[-1]
    assert isinstance(second, m.TaskComplete), second
    # the conversation held the first prompt: the second evaluated at most what the history added after it
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.stats["prompt_evaluated"] <= second.usage.prompt_tokens - first.usage.prompt_tokens


def test_tool_choice_none_and_a_raw_prompt_make_no_call(peer: RawPeer) -> None:
    start(peer, "quiet")
    done = infer(peer, "none", session_id="quiet", messages=ASK, tool_choice="none", max_tokens=6)[-1]
    assert isinstance(done, m.TaskComplete) and done.tool_call is None and "tool_format" not in done.stats
    raw = infer(peer, "raw", session_id="quiet", prompt="<tool_call>", max_tokens=4)[-1]
    assert isinstance(raw, m.TaskComplete) and raw.tool_call is None and "tool_format" not in raw.stats


BAD_TOOLS = [
    ({"name": "search"}, "tools"),  # an object, not a list
    ([{"name": "search"}], "tools[0]"),  # not OpenAI's {"type": "function", "function": ...}
    ([{"type": "function", "function": {"name": "bad name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"not": {"type": "integer"}}}}}}], "tools[0].function.parameters"),
]


@pytest.mark.parametrize(("tools", "param"), BAD_TOOLS, ids=[param for _, param in BAD_TOOLS])
def test_bad_tools_refuse_the_session_and_the_connection_goes_on(app: Running, peer: RawPeer, tools: Any,
                                                                 param: str) -> None:
    refused = start(peer, "refused", tools)
    assert isinstance(refused, m.ErrorMessage) and refused.task_id == "start-refused", refused
    assert refused.error.code == "BAD_REQUEST" and refused.error.details["param"].startswith(param), refused
    assert "refused" not in app.daemon.agents
    assert isinstance(start(peer, "refused", TOOLS), m.TaskStart)  # the same connection, the same name: served


@pytest.mark.parametrize(("choice", "param"), [("required", "tool_choice"),
                                               ({"type": "function", "function": {"name": "nope"}},
                                                "tool_choice.function.name"),
                                               ({"name": "get_weather"}, "tool_choice")])
def test_a_tool_choice_the_tools_cannot_meet_is_refused(peer: RawPeer, choice: Any, param: str) -> None:
    start(peer, "chooser")
    stateless = infer(peer, "stateless", model="qwen", messages=ASK, tool_choice=choice)[-1]  # no session: no tools
    assert isinstance(stateless, m.ErrorMessage) and stateless.error.code == "BAD_REQUEST", stateless
    if choice != "required":
        named = infer(peer, "named", session_id="chooser", messages=ASK, tool_choice=choice)[-1]
        assert isinstance(named, m.ErrorMessage) and named.error.details["param"] == param, named
    done = infer(peer, "after", session_id="chooser", messages=ASK, tool_choice="required")[-1]
    assert isinstance(done, m.TaskComplete) and done.stop_reason == "tool_call"


def test_messages_use_the_template_and_prompts_are_raw_text(app: Running, peer: RawPeer) -> None:
    """The template's markers are one control token each in a MAGN chat (llama.cpp's count of the rendered text
    with control tokens); the same marker texts in a MAGN ``prompt`` or a line-protocol DECODE are letters
    (llama.cpp's count without control tokens)."""
    path = app.daemon.resolve("qwen").path
    vocab = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)

    def count(text: str, *, special: bool) -> int:
        return len(vocab.tokenize(text.encode(), add_bos=False, special=special))

    turn = [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]
    done = infer(peer, "chat", model="qwen", messages=turn, max_tokens=1)[-1]
    assert isinstance(done, m.TaskComplete), done
    rendered = render_prompt(read_chat_template(path), [Message(t["role"], t["content"]) for t in turn]).text
    assert rendered.count("<|im_start|>") == 3
    assert done.usage.prompt_tokens == count(rendered, special=True)

    marked = "<|im_start|>user hi<|im_end|>"
    assert count(marked, special=False) > count(marked, special=True) + 6  # each marker is several tokens of text
    raw = infer(peer, "raw", model="qwen", prompt=marked, max_tokens=1)[-1]
    assert isinstance(raw, m.TaskComplete) and raw.usage.prompt_tokens == count(marked, special=False), raw
    assert app.line("REGISTER raw qwen").startswith("OK")
    reply = lines.parse_reply(app.line(f"DECODE raw 1 {marked}"))
    assert int(reply.fields["prompt_tokens"]) == count(marked, special=False)


# -- the pure parts: sampling settings, and the TASK_COMPLETE of an answer ----------------------------------------


def test_sampling_takes_each_setting_the_request_gives() -> None:
    request = m.InferRequest("t", model="m", messages=ASK, stream=True, logprobs=True, seed=9, top_k=5, min_p=0.1,
                             repeat_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.25, temperature=0.7)
    sampling = sampling_of(request, None)
    assert (sampling.seed, sampling.top_k, sampling.min_p, sampling.logprobs) == (9, 5, 0.1, 0)
    assert (sampling.repeat_penalty, sampling.frequency_penalty, sampling.presence_penalty) == (1.2, 0.5, -0.25)
    plain = sampling_of(m.InferRequest("t", model="m", prompt="p"), None)
    assert (plain.top_k, plain.min_p, plain.repeat_penalty, plain.logprobs) == (40, 0.0, 1.0, None)


def result(text: str, stop_reason: Any = "eos") -> DecodeResult:
    return DecodeResult(None, "qwen", Generation(text, (1, 2, 3), 5, stop_reason, 0.1, 0.01), None, False)


CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


def test_a_whole_call_is_the_tool_call_and_the_text_is_what_is_around_it() -> None:
    done = completion("t", result("Let me see. " + CALL_TEXT), toolcalls.HERMES)
    assert done.stop_reason == "tool_call" and done.text == "Let me see."
    assert done.tool_call is not None and (done.tool_call.name, done.tool_call.arguments) == ("get_time",
                                                                                               {"zone": "UTC"})
    assert done.stats["tool_format"] == "hermes"


@pytest.mark.parametrize("stop_reason", ["length", "stop"])
def test_a_call_cut_short_keeps_its_raw_text(stop_reason: Any) -> None:
    cut = CALL_TEXT[:40]
    done = completion("t", result(cut, stop_reason), toolcalls.HERMES)
    assert done.tool_call is None and done.text == cut and done.stop_reason == stop_reason


@pytest.mark.parametrize("arguments", ['{"n": 1e999}', '{"a": ' * 70 + "1" + "}" * 70],
                         ids=["past-float-range", "past-frame-depth"])
def test_a_call_a_frame_cannot_carry_keeps_its_raw_text(arguments: str) -> None:
    text = f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>'
    done = completion("t", result(text), toolcalls.HERMES)
    assert done.tool_call is None and done.stop_reason == "stop" and done.text == text
    assert m.parse_message(done.to_payload()) == done


def test_an_answer_without_a_call_is_its_content() -> None:
    done = completion("t", result('{"response": "It is sunny."}'), toolcalls.GENERIC)
    assert done.tool_call is None and done.stop_reason == "stop" and done.text == "It is sunny."
    plain = completion("t", result(CALL_TEXT))  # no tools in play: nothing is parsed
    assert plain.tool_call is None and plain.text == CALL_TEXT and "tool_format" not in plain.stats


def test_streamed_token_logprobs_are_finite_and_at_most_zero() -> None:
    from appliance.engine.interface import Token, TokenLogprob, TokenLogprobs
    from appliance.server.magn import UNLIKELY_LOGPROB, logprob_of

    def token(logprob: float) -> Token:
        return Token(1, "a", 0, 0.0, TokenLogprobs(TokenLogprob(1, b"a", logprob)))

    assert logprob_of(token(-0.5)) == -0.5
    assert logprob_of(token(float("-inf"))) == UNLIKELY_LOGPROB
    assert logprob_of(Token(1, "a", 0, 0.0)) is None
    assert json.dumps(m.StreamToken("t", "a", 1, 0.0, logprob_of(token(float("-inf")))).to_payload())

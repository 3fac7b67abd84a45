"""Tool calls (appliance.engine.toolcalls): detection on the vendored templates, each format's grammar for each
tool_choice checked by llama.cpp's own grammar parser and sampler (tests/grammar_check.py), the lazy triggers'
safety, and the parsers, whole and streamed."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from grammar_check import GrammarCheck, triggered_at
from vendored import template_path, vocab_path

from appliance.engine import structured, toolcalls
from appliance.engine.toolcalls import (
    FORMATS,
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_ARGS,
    MISTRAL_ARGS_ID,
    CallArguments,
    CallStart,
    Content,
    Format,
    Named,
    StreamParser,
    ToolCall,
)
from appliance.errors import ApplianceError

TOOLS_JSON = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query", "limit"]}}},
    {"type": "function", "function": {"name": "now"}},
]
TOOLS = toolcalls.parse_tools(TOOLS_JSON)
WEATHER = ("get_weather", {"city": "Paris", "unit": "c"})
SEARCH = ("search", {"query": "llama \"grammar\"\n", "limit": 3})
NOW = ("now", {})


@pytest.fixture(scope="module")
def check(vendored: Path) -> Iterator[GrammarCheck]:
    checker = GrammarCheck(vocab_path(vendored, "llama-bpe"))
    yield checker
    checker.close()


def written(fmt: Format, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """``calls`` as the model writes them in ``fmt`` (the canonical spacing, which the grammars accept)."""
    if fmt is HERMES:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt is MISTRAL:
        return "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a, "id": "abc123XYZ"})
                                           for n, a in calls) + "]"
    if fmt is MISTRAL_ARGS_ID:
        return "".join(f"[TOOL_CALLS]{n}[CALL_ID]abc123XYZ[ARGS]{json.dumps(a)}" for n, a in calls)
    if fmt is MISTRAL_ARGS:
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if fmt is LLAMA3:
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


# -- detection -----------------------------------------------------------------------------------------------------

DETECTED = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "Qwen-QwQ-32B": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-args-id",
    "unsloth-mistral-Devstral-Small-2507": "mistral-args",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral-args",
    "microsoft-Phi-3.5-mini-instruct": "generic",
    "google-gemma-2-2b-it": "generic",
    "Qwen3-Coder": "generic",  # <tool_call><function=...>: an XML form this table does not have
    "GLM-4.6": "generic",
}


@pytest.mark.parametrize(("template", "expected"), sorted(DETECTED.items()))
def test_the_format_is_detected_from_the_vendored_template(vendored: Path, template: str, expected: str) -> None:
    assert toolcalls.detect(template_path(vendored, template).read_text(encoding="utf-8")).name == expected


def test_a_model_without_a_template_uses_the_generic_format() -> None:
    assert toolcalls.detect(None) is GENERIC
    assert [fmt.name for fmt in FORMATS][-1] == "generic"


# -- grammars ------------------------------------------------------------------------------------------------------

CHOICES: list[toolcalls.Choice] = ["required", "auto", Named("search")]


@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
@pytest.mark.parametrize("choice", CHOICES, ids=["required", "auto", "named"])
@pytest.mark.parametrize("fmt", FORMATS, ids=[fmt.name for fmt in FORMATS])
def test_each_formats_grammar_spells_valid_calls_only(check: GrammarCheck, fmt: Format, choice: toolcalls.Choice,
                                                      parallel: bool) -> None:
    grammar = toolcalls.grammar(fmt, TOOLS, choice, parallel)
    assert grammar is not None
    lazy = choice == "auto" and fmt is not GENERIC
    assert grammar.lazy == lazy
    with check.sampler(grammar):
        pass  # llama.cpp parses it, lazy patterns included
    named = isinstance(choice, Named)
    allowed = [SEARCH] if named else [WEATHER, SEARCH, NOW]
    for call in allowed:
        assert check.accepts(grammar, written(fmt, [call]), lazy=False), f"{call} refused"
    several = check.accepts(grammar, written(fmt, [WEATHER, SEARCH]), lazy=False)
    assert several == (parallel and fmt.parallel and not named)
    refused = [("get_weather", {"city": 3}), ("get_weather", {"unit": "c"}), ("search", {"query": "q"}),
               ("unknown", {}), ("now", {"x": 1})]
    if named:
        refused.append(WEATHER)
    for call in refused:
        assert not check.accepts(grammar, written(fmt, [call]), lazy=False), f"{call} accepted"
    assert not check.accepts(grammar, "I will not call anything.", lazy=False)
    response = check.accepts(grammar, json.dumps({"response": "Hello \"there\"\n"}), lazy=False)
    assert response == (fmt is GENERIC and choice == "auto")


def test_none_or_no_tools_is_no_grammar() -> None:
    for fmt in FORMATS:
        assert toolcalls.grammar(fmt, TOOLS, "none", True) is None
        assert toolcalls.grammar(fmt, (), "auto", True) is None


def test_an_auto_grammar_leaves_text_free_until_its_marker(check: GrammarCheck) -> None:
    grammar = toolcalls.grammar(HERMES, TOOLS, "auto", True)
    assert grammar is not None
    text = "Let me look that up.\n" + written(HERMES, [WEATHER, SEARCH])
    start = text.index("<tool_call>")
    tokens = check.tokens(text)
    with check.sampler(grammar) as sampler:
        position = 0
        for token in tokens:
            if position < start:  # free text: anything goes
                assert check.allowed(sampler, check.tokens(" zzz")[0])
            assert check.feed(sampler, [token])
            position += len(check.piece(token))
        assert not check.allowed(sampler, check.tokens(" zzz")[0])  # after calls: nothing but the end
        assert check.allowed(sampler, check.eos)


def token_splits(check: GrammarCheck, text: str) -> Iterator[list[str]]:
    """``text`` split as the tokenizer does, one character at a time, and at random points."""
    yield [check.piece(token) for token in check.tokens(text)]
    yield list(text)
    rng = random.Random(7)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


TRIGGER_CASES = {
    "hermes": ["Sure.\n" + written(HERMES, [WEATHER]), written(HERMES, [SEARCH, NOW]), "<tool_call>\n{\"nam",
               "see <tool_call> tag", "<tool_call>\n{\"name\": \"unknown\"}", "<tool_call><tool_call>\n{"],
    "mistral": ["ok " + written(MISTRAL, [WEATHER, NOW]), "[TOOL_CALLS] nope", "[TOOL_CALLS][{\"name\": \"get\"}"],
    "mistral-args-id": ["x" + written(MISTRAL_ARGS_ID, [SEARCH]), "[TOOL_CALLS]searc", "[TOOL_CALLS]search[ARGS]{",
                        "[TOOL_CALLS]getx[CALL_ID]"],
    "mistral-args": [written(MISTRAL_ARGS, [WEATHER, SEARCH]), "[TOOL_CALLS]now[CALL_ID]abc"],
    "llama3": [written(LLAMA3, [WEATHER]), "  " + written(LLAMA3, [NOW]), '{"answer": 42}',
               'Hi {"name": "now", "parameters": {}}', "<|python_tag|>" + written(LLAMA3, [SEARCH]),
               '{"name": "nowhere"}'],
}


@pytest.mark.parametrize("fmt", [fmt for fmt in FORMATS if fmt is not GENERIC], ids=lambda fmt: fmt.name)
def test_a_lazy_grammar_only_starts_where_the_grammar_accepts_the_text_so_far(check: GrammarCheck,
                                                                              fmt: Format) -> None:
    """llama.cpp feeds the text from the trigger's match on to the grammar: if the grammar refused it there, the
    process would abort. Every prefix that matches must be one the grammar accepts, and a real call triggers."""
    grammar = toolcalls.grammar(fmt, TOOLS, "auto", True)
    assert grammar is not None and grammar.trigger_patterns
    for text in TRIGGER_CASES[fmt.name]:
        is_call = toolcalls.parse(fmt, text)[1] != []
        for pieces in token_splits(check, text):
            buffer = ""
            fired = False
            for piece in pieces:
                buffer += piece
                start = triggered_at(grammar.trigger_patterns, buffer)
                if start is not None:
                    replay = buffer[start:]
                    assert check.accepts(grammar, replay, complete=False, lazy=False), (text, pieces, replay)
                    fired = True
                    break
            if is_call and not text.startswith("Hi "):
                assert fired, (text, pieces)


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL, MISTRAL_ARGS_ID, LLAMA3], ids=lambda fmt: fmt.name)
def test_llama_cpps_lazy_sampler_takes_an_answer_with_calls(check: GrammarCheck, fmt: Format) -> None:
    grammar = toolcalls.grammar(fmt, TOOLS, "auto", fmt.parallel)
    assert grammar is not None
    before = "" if fmt is LLAMA3 else "Checking now. "
    text = before + written(fmt, [WEATHER, SEARCH] if fmt.parallel else [WEATHER])
    pieces = [check.piece(token) for token in check.tokens(text)]
    buffer = ""
    for piece in pieces:  # the trigger is checked here first: a wrong one would abort the process below
        buffer += piece
        start = triggered_at(grammar.trigger_patterns, buffer)
        if start is not None:
            assert check.accepts(grammar, buffer[start:], complete=False, lazy=False)
            break
    assert check.accepts(grammar, text)
    assert not check.accepts(grammar, text.replace("Paris", "Paris\u0001"))


# -- parsing -------------------------------------------------------------------------------------------------------


class SequentialIds:
    """Call ids id0, id1, ... (readable expectations)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> str:
        self.next += 1
        return f"id{self.next - 1}"


def sequential_ids() -> Callable[[], str]:
    return SequentialIds()


def calls_of(*calls: tuple[str, Any]) -> list[tuple[str, Any]]:
    return list(calls)


# (format, output, content, [(name, arguments as parsed JSON, or the raw text when it is not JSON)])
PARSED: list[tuple[Format, str, str, list[tuple[str, Any]]]] = [
    (HERMES, "Just text, no call.", "Just text, no call.", []),
    (HERMES, written(HERMES, [WEATHER]), "", calls_of(WEATHER)),
    (HERMES, "Let me check.\n\n" + written(HERMES, [WEATHER, SEARCH]) + "\nDone.", "Let me check.\nDone.",
     calls_of(WEATHER, SEARCH)),
    (HERMES, '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>', "",
     [("get_weather", {"city": "Rome"})]),
    (HERMES, "a <tool_call> b", "a <tool_call> b", []),
    (HERMES, '<tool_call>\n{"name": "search", "arguments": {"query": "cut sh', "",
     [("search", '{"query": "cut sh')]),
    (HERMES, '<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", {})]),
    (HERMES, '<tool_call>\n{"nam', '<tool_call>\n{"nam', []),
    (MISTRAL, written(MISTRAL, [WEATHER, SEARCH]), "", calls_of(WEATHER, SEARCH)),
    (MISTRAL, "Sure " + written(MISTRAL, [NOW]), "Sure", calls_of(NOW)),
    (MISTRAL, "[TOOL_CALLS] plain", "[TOOL_CALLS] plain", []),
    (MISTRAL_ARGS_ID, written(MISTRAL_ARGS_ID, [WEATHER, NOW]), "", calls_of(WEATHER, NOW)),
    (MISTRAL_ARGS_ID, "Hm. " + written(MISTRAL_ARGS_ID, [SEARCH]) + " ok", "Hm.\nok", calls_of(SEARCH)),
    (MISTRAL_ARGS, written(MISTRAL_ARGS, [SEARCH]), "", calls_of(SEARCH)),
    (MISTRAL_ARGS, "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
    (LLAMA3, written(LLAMA3, [WEATHER]), "", calls_of(WEATHER)),
    (LLAMA3, written(LLAMA3, [WEATHER, NOW]), "", calls_of(WEATHER, NOW)),
    (LLAMA3, '{"type": "function", "name": "now", "parameters": {}}', "", calls_of(NOW)),
    (LLAMA3, "<|python_tag|>" + written(LLAMA3, [SEARCH]), "", calls_of(SEARCH)),
    (LLAMA3, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA3, "The JSON is {\"name\": \"x\"}.", "The JSON is {\"name\": \"x\"}.", []),
    (GENERIC, written(GENERIC, [WEATHER, SEARCH]), "", calls_of(WEATHER, SEARCH)),
    (GENERIC, json.dumps({"response": "Hello \"you\"\n\u00e9 \U0001f600"}), "Hello \"you\"\n\u00e9 \U0001f600", []),
    (GENERIC, '{"tool_call": {"name": "now", "arguments": {}}}', "", calls_of(NOW)),
    (GENERIC, '{"other": 1}', '{"other": 1}', []),
    (GENERIC, "not JSON at all", "not JSON at all", []),
]


def decoded(call: ToolCall) -> tuple[str, Any]:
    try:
        return call.name, json.loads(call.arguments)
    except ValueError:
        return call.name, call.arguments


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), PARSED,
                         ids=[f"{case[0].name}-{index}" for index, case in enumerate(PARSED)])
def test_a_finished_output_parses_to_its_content_and_calls(fmt: Format, output: str, content: str,
                                                           calls: list[tuple[str, Any]]) -> None:
    got_content, got_calls = toolcalls.parse(fmt, output, sequential_ids())
    assert got_content == content
    assert [decoded(call) for call in got_calls] == calls
    assert [call.id for call in got_calls] == [f"id{i}" for i in range(len(calls))]


def streamed(fmt: Format, pieces: list[str]) -> list[toolcalls.Event]:
    parser = StreamParser(fmt, sequential_ids())
    events: list[toolcalls.Event] = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.finish())
    return events


@pytest.mark.parametrize(("fmt", "output", "content", "calls"), PARSED,
                         ids=[f"{case[0].name}-{index}" for index, case in enumerate(PARSED)])
def test_a_streamed_output_ends_as_the_whole_one_however_it_is_cut(fmt: Format, output: str, content: str,
                                                                   calls: list[tuple[str, Any]]) -> None:
    whole = toolcalls.parse(fmt, output, sequential_ids())
    rng = random.Random(11)
    cuts = [list(output), [output]]
    for _ in range(6):
        points = sorted(rng.sample(range(1, len(output)), min(len(output) - 1, rng.randint(1, 10))))
        cuts.append([output[a:b] for a, b in zip([0, *points], [*points, len(output)], strict=True)])
    for pieces in cuts:
        events = streamed(fmt, pieces)
        assert toolcalls.collect(events) == whole
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [e.index for e in starts] == list(range(len(calls)))
        for event in events:
            if isinstance(event, CallArguments):  # a call's pieces come after its start, once per call
                assert any(start.index == event.index for start in starts[:event.index + 1])
            if isinstance(event, Content):
                assert event.text
                if calls:
                    assert not any(marker in event.text for marker in fmt.markers), event


def test_arguments_stream_as_they_arrive_and_markers_are_held_back() -> None:
    parser = StreamParser(HERMES, sequential_ids())
    assert parser.feed("Let me check. <tool") == [Content("Let me check.")]
    assert parser.feed("_call>\n{\"name\": \"sea") == []
    assert parser.feed("rch\", \"arguments\": {\"query\": \"ll") == [CallStart(0, "id0", "search"),
                                                                       CallArguments(0, '{"query": "ll')]
    assert parser.feed("ama\", \"limit\": 2}") == [CallArguments(0, 'ama", "limit": 2}')]
    assert parser.feed("}\n</tool_call>") == []
    assert parser.finish() == []


def test_a_generic_response_streams_as_content() -> None:
    parser = StreamParser(GENERIC, sequential_ids())
    assert parser.feed('{"response": "Hel') == [Content("Hel")]
    assert parser.feed('lo\\n wor') == [Content("lo\n wor")]
    assert parser.feed('ld \\u00e9"}') == [Content("ld \u00e9")]
    assert parser.finish() == []


def test_ids_are_new_and_shaped_for_their_format() -> None:
    _, hermes = toolcalls.parse(HERMES, written(HERMES, [WEATHER, NOW]))
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in hermes)
    assert hermes[0].id != hermes[1].id
    _, mistral = toolcalls.parse(MISTRAL, written(MISTRAL, [WEATHER]))
    assert len(mistral[0].id) == 9 and mistral[0].id.isalnum() and mistral[0].id != "abc123XYZ"


# -- tools and tool_choice -----------------------------------------------------------------------------------------


def test_tools_are_read_with_defaults() -> None:
    assert [tool.name for tool in TOOLS] == ["get_weather", "search", "now"]
    assert TOOLS[2].description == "" and TOOLS[2].parameters == {"type": "object", "properties": {}}
    assert TOOLS[0].openai() == TOOLS_JSON[0]
    assert toolcalls.parse_tools(None) == ()


@pytest.mark.parametrize(("value", "param"), [
    ("get_weather", "tools"),
    ([{"type": "code_interpreter"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "x"}}, {"type": "function", "function": {"name": "x"}}],
     "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "x", "parameters": {
        "type": "object", "properties": {"n": {"not": {"type": "integer"}}}}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "x", "returns": {}}}], "tools[0].function.returns"),
    ([{"type": "function", "function": {"name": "x", "description": 5}}], "tools[0].function.description"),
])
def test_bad_tools_are_refused_naming_the_field(value: Any, param: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        toolcalls.parse_tools(value)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details["param"] == param


def test_an_unsupported_keyword_in_parameters_names_it() -> None:
    with pytest.raises(ApplianceError) as caught:
        toolcalls.parse_tools([{"type": "function", "function": {"name": "x", "parameters": {
            "type": "object", "properties": {"n": {"allOf": [{"type": "integer"}]}}}}}])
    assert caught.value.details["keyword"] == "allOf" and caught.value.details["path"] == "/properties/n"


AGENT_CLI_PARAMETERS = {  # the shapes an agent CLI's tools use (Claude Code's Read, TaskCreate, WebFetch, Workflow)
    "$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "additionalProperties": False,
    "required": ["url"],
    "properties": {
        "url": {"type": "string", "format": "uri", "description": "The URL"},
        "offset": {"type": "integer", "minimum": 0, "maximum": 9007199254740991},
        "limit": {"type": "integer", "exclusiveMinimum": 0},
        "metadata": {"type": "object", "propertyNames": {"type": "string"}, "additionalProperties": {}},
        "script": {"type": "string", "maxLength": 100000},
        "mode": {"oneOf": [{"const": "fast"}, {"const": "slow"}]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    },
}


def test_a_tools_validation_keywords_are_relaxed_not_refused() -> None:
    """Agents' tool schemas are written for validators: what only narrows the values is left to the grammar's
    looser reading (the template still shows the schema as sent); response_format keeps refusing it."""
    tool = toolcalls.parse_tools([{"type": "function", "function": {"name": "fetch",
                                                                     "parameters": AGENT_CLI_PARAMETERS}}])[0]
    assert tool.parameters == AGENT_CLI_PARAMETERS  # as sent: the template renders this
    relaxed, dropped = structured.relax(AGENT_CLI_PARAMETERS)
    assert sorted(dropped) == sorted([
        "format at /properties/url", "minimum at /properties/offset", "maximum at /properties/offset",
        "exclusiveMinimum at /properties/limit", "propertyNames at /properties/metadata",
        "maxLength at /properties/script", "uniqueItems at /properties/tags"])
    assert relaxed["properties"]["mode"] == {"anyOf": [{"const": "fast"}, {"const": "slow"}]}
    assert relaxed["properties"]["url"] == {"type": "string", "description": "The URL"}
    assert toolcalls.grammar(HERMES, (tool,), "required", parallel=False) is not None
    with pytest.raises(ApplianceError) as strict:
        structured.response_grammar({"type": "json_schema", "json_schema": {"name": "x",
                                                                             "schema": AGENT_CLI_PARAMETERS}})
    assert strict.value.details["keyword"] in {"format", "minimum", "maximum", "exclusiveMinimum", "propertyNames",
                                               "maxLength", "oneOf", "uniqueItems"}


def test_tool_choice() -> None:
    assert toolcalls.parse_choice(None, TOOLS) == "auto"
    assert toolcalls.parse_choice("none", ()) == "none"
    assert toolcalls.parse_choice("required", TOOLS) == "required"
    assert toolcalls.parse_choice({"type": "function", "function": {"name": "now"}}, TOOLS) == Named("now")
    refused = [("required", (), "tool_choice"), ({"type": "function", "function": {"name": "nope"}}, TOOLS,
                                                 "tool_choice.function.name"),
               ("always", TOOLS, "tool_choice"), ({"type": "function", "function": "now"}, TOOLS, "tool_choice")]
    for value, tools, param in refused:
        with pytest.raises(ApplianceError) as caught:
            toolcalls.parse_choice(value, tools)
        assert caught.value.code == "BAD_REQUEST" and caught.value.details["param"] == param


def test_the_generic_formats_texts() -> None:
    described = toolcalls.system_text(TOOLS)
    assert "get_weather" in described and "The weather in a city" in described and '"tool_calls"' in described
    history = toolcalls.calls_text([ToolCall("call_1", "now", "{}"), ToolCall("call_2", "search", "not json")], "")
    assert json.loads(history) == {"tool_calls": [{"name": "now", "arguments": {}, "id": "call_1"},
                                                  {"name": "search", "arguments": "not json", "id": "call_2"}]}
    results = toolcalls.results_text([toolcalls.ToolResult("call_1", "now", "12:00")])
    assert json.loads(results) == {"tool_results": [{"tool_call_id": "call_1", "name": "now", "content": "12:00"}]}

"""The Responses API's pure parts (appliance.http.responses_schema): requests read into the chat path's request,
every refusal naming its field, output items and stream events built from a call parser's events."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.engine import toolcalls
from appliance.engine.chat import Message
from appliance.errors import ApplianceError
from appliance.http import responses_schema as schema
from appliance.protocol.messages import MAX_CHAT_MESSAGES

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}


def request(**fields: Any) -> schema.ResponsesRequest:
    return schema.responses_request({"model": "m", "input": "Hi", **fields})


def test_input_items_become_chat_messages() -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                      "text": "in Oslo?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {**CALL, "id": "fc_1", "status": "completed"},
             {**CALL, "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
             {"role": "developer", "content": "Be terse."}]
    calls = (toolcalls.ToolCall("call_1", "get_weather", CALL["arguments"]),
             toolcalls.ToolCall("call_2", "get_weather", CALL["arguments"]))
    assert schema.input_messages(items) == (Message("user", "Weather in Oslo?"),
                                            Message("assistant", "Let me look.", calls),
                                            Message("tool", "Sunny", tool_call_id="call_1"),
                                            Message("developer", "Be terse."))
    assert schema.input_messages([CALL]) == (Message("assistant", None, calls[:1]),)
    assert schema.input_messages("Hi") == (Message("user", "Hi"),)


def test_a_request_is_the_chat_paths_request() -> None:
    checked = request(instructions="Be terse.", temperature=0.5, top_p=0.9, max_output_tokens=7, tools=[WEATHER],
                      tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                      metadata={"k": "v"}, store=False, previous_response_id="resp_abc123", user="someone")
    history = (Message("user", "Before"), Message("assistant", "Yes"))
    chat = checked.chat_request(history)
    assert chat.messages == (Message("system", "Be terse."), *history, Message("user", "Hi"))
    assert (chat.temperature, chat.top_p, chat.max_tokens, chat.parallel_tool_calls) == (0.5, 0.9, 7, False)
    assert chat.tools == (toolcalls.Tool("get_weather", "The weather", WEATHER["parameters"]),)
    assert chat.tool_choice == toolcalls.Named("get_weather") and chat.user is None
    assert (checked.store, checked.previous_response_id, checked.metadata) == (False, "resp_abc123", {"k": "v"})
    assert request().store is True and request().options.response_grammar is None


def test_text_format_is_a_grammar() -> None:
    fmt = {"type": "json_schema", "name": "answer", "strict": True,
           "schema": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}
    with_schema = request(text={"format": fmt}).options.response_grammar
    any_object = request(text={"format": {"type": "json_object"}}).options.response_grammar
    assert with_schema is not None and any_object is not None and with_schema != any_object
    assert request(text={"format": {"type": "text"}, "verbosity": "low"}).options.response_grammar is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": [{**CALL, "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{**CALL, "call_id": ""}]}, "input[0].call_id"),
    ({"input": [{**CALL, "name": "bad name"}]}, "input[0].name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"input": ["x"] * (MAX_CHAT_MESSAGES + 1)}, "input"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    ({"tools": ["web_search"]}, "tools[0]"),
    ({"tools": [{"type": "namespace", "name": "a b", "tools": [WEATHER]}]}, "tools[0].name"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": "all"}]}, "tools[0].tools"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0]"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{**WEATHER, "color": 1}]}]}, "tools[0].tools[0].color"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [WEATHER], "extra": 1}]}, "tools[0].extra"),
    ({"tools": [{"type": "namespace", "name": "n" * 60, "tools": [WEATHER]}]}, "tools[0].tools[0].name"),
    ({"tools": [{**WEATHER, "name": "ns__get_weather"},
                {"type": "namespace", "name": "ns", "tools": [WEATHER]}]}, "tools[1].tools[0].name"),
    ({"input": [{**CALL, "namespace": "a b"}]}, "input[0].namespace"),
    ({"tools": [{**WEATHER, "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "color": 1}]}, "tools[0].color"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER]}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"reasoning": {"budget": 1}}, "reasoning.budget"),
    ({"reasoning": "high"}, "reasoning"),
    ({"include": "reasoning.encrypted_content"}, "include"),
    ({"client_metadata": {"k": 1}}, "client_metadata"),
    ({"client_metadata": ["k"]}, "client_metadata"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"previous_response_id": "chatcmpl-1"}, "previous_response_id"),
    ({"store": "yes"}, "store"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
])
def test_each_refusal_names_its_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        request(**fields)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details["param"] == param, caught.value.message


def test_reasoning_settings_encrypted_reasoning_and_client_metadata_are_accepted() -> None:
    checked = request(reasoning={"effort": "high", "summary": "auto"}, include=["reasoning.encrypted_content"],
                      prompt_cache_key="k1", client_metadata={"thread_id": "t1"})
    assert checked.input == (Message("user", "Hi"),) and checked.options == request().options
    assert request(reasoning={"effort": None, "summary": "detailed", "generate_summary": "concise"}).input == (
        Message("user", "Hi"),)


def test_built_in_tools_are_not_shown_to_the_model() -> None:
    built_in = [{"type": "web_search", "external_web_access": False}, {"type": "file_search", "vector_store_ids": []},
                {"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"},
                {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
                {"type": "mcp", "server_label": "x"}, {"type": "local_shell"}, {"type": "web_search_preview"}]
    checked = request(tools=[*built_in, WEATHER])
    assert [tool.name for tool in checked.tools] == ["get_weather"]
    assert checked.echo["tools"] == [*built_in, WEATHER]  # the document repeats what was asked for
    assert request(tools=built_in[:1]).tools == () and not request(tools=built_in[:1]).calls_tools


def test_namespace_tools_are_served_flattened_and_their_calls_named_back() -> None:
    namespace = {"type": "namespace", "name": "crm", "description": "The CRM", "tools": [WEATHER]}
    checked = request(tools=[namespace, {**WEATHER, "name": "lookup"}])
    assert [tool.name for tool in checked.tools] == ["crm__get_weather", "lookup"]
    assert checked.tools[0].description == "The weather" and checked.tools[0].parameters == WEATHER["parameters"]
    output = schema.Output(namespaced=checked.namespaced)
    events = output.feed([toolcalls.CallStart(0, "call_1", "crm__get_weather"), toolcalls.CallArguments(0, "{}"),
                          toolcalls.CallStart(1, "call_2", "lookup"), toolcalls.CallArguments(1, "{}")])
    events += output.finish(incomplete=False)
    first, second = output.items
    assert (first["namespace"], first["name"]) == ("crm", "get_weather") and "namespace" not in second
    assert second["name"] == "lookup"
    done = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert [event["name"] for event in done] == ["get_weather", "lookup"]
    # a namespaced call sent back (or stored) is the flattened call the model made
    assert schema.input_messages(output.items) == (Message("assistant", None, (
        toolcalls.ToolCall("call_1", "crm__get_weather", "{}"), toolcalls.ToolCall("call_2", "lookup", "{}"))),)


def test_a_too_long_conversation_is_refused() -> None:
    with pytest.raises(ApplianceError) as caught:
        request().chat_request([Message("user", "x")] * MAX_CHAT_MESSAGES)
    assert caught.value.details["param"] == "input" and caught.value.details["max_items"] == MAX_CHAT_MESSAGES


def test_output_events_announce_each_item_in_order() -> None:
    output = schema.Output(first_sequence=2)
    events = output.feed([toolcalls.Content("Hel"), toolcalls.Content("lo"), toolcalls.CallStart(0, "call_1", "f"),
                          toolcalls.CallArguments(0, '{"a":'), toolcalls.CallArguments(0, "1}")])
    events += output.finish(incomplete=False)
    assert [event["type"] for event in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [event["sequence_number"] for event in events] == list(range(2, 2 + len(events)))
    assert output.sequence == 2 + len(events)
    message, call = output.items
    assert message["content"][0]["text"] == "Hello" and events[4]["text"] == "Hello"
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    assert events[6]["item"] == message and message["status"] == "completed"
    assert call == {"id": call["id"], "type": "function_call", "status": "completed", "call_id": "call_1",
                    "name": "f", "arguments": '{"a":1}'}
    assert events[7]["item"]["arguments"] == "" and events[7]["output_index"] == 1
    assert events[10]["arguments"] == '{"a":1}' and events[10]["item_id"] == call["id"]
    # the output read back as input is the conversation's next history
    assert schema.input_messages(output.items) == (
        Message("assistant", "Hello", (toolcalls.ToolCall("call_1", "f", '{"a":1}'),)),)


def test_an_empty_or_cut_output() -> None:
    empty = schema.Output()
    events = empty.finish(incomplete=True)
    assert [item["content"][0]["text"] for item in empty.items] == [""] and empty.items[0]["status"] == "incomplete"
    assert [event["type"] for event in events][-1] == "response.output_item.done"


def test_the_document_and_its_usage() -> None:
    checked = request(instructions="Be terse.", max_output_tokens=3, metadata={"k": "v"})
    counts = schema.usage(10, 3, 4)
    assert counts == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}
    document = schema.response("resp_1", 5, checked, "incomplete", [], counts)
    assert document["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (document["instructions"], document["max_output_tokens"], document["metadata"]) == ("Be terse.", 3,
                                                                                             {"k": "v"})
    assert schema.response("resp_1", 5, checked, "completed", [], counts)["incomplete_details"] is None
    assert schema.incomplete("length") and not schema.incomplete("eos") and not schema.incomplete("stop")


def test_an_error_event_carries_the_p4_error() -> None:
    body = {"error": {"code": "TOO_MANY_AGENTS", "message": "full", "retryable": True, "details": {"max_agents": 2},
                      "type": "rate_limit_error", "param": None}}
    assert schema.error_event(body, 7) == {"type": "error", "code": "TOO_MANY_AGENTS", "message": "full",
                                           "param": None, "retryable": True, "details": {"max_agents": 2},
                                           "sequence_number": 7}
    assert schema.event({"type": "x", "a": 1}) == b'event: x\ndata: {"type":"x","a":1}\n\n'

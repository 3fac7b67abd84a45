"""Real agent CLIs against a real appliance: Claude Code (``@anthropic-ai/claude-code``) runs ``claude -p`` with
``ANTHROPIC_BASE_URL`` at the appliance, and Codex (``@openai/codex``) runs ``codex exec`` with the appliance as its
Responses API provider; each is installed from npm into a cache folder once per machine (skipped with npm's reason
when it cannot be), names aliases of a tiny real-vocab model, and prints a streamed answer. First, the pure
translation of what each sends (its request, condensed from a sniffed one)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Running, running
from test_real_vocab import CASES

from appliance.engine import toolcalls
from appliance.engine.chat import Message
from appliance.engine.interface import Grammar
from appliance.errors import ApplianceError
from appliance.http import anthropic_schema as schema
from appliance.http import responses_schema

CLAUDE_CODE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.197"
CODEX = "@openai/codex"
CODEX_VERSION = "0.171.0"
CODEX_ALIAS = "codex-local"  # what Codex's config.toml names as its model
MAIN_ALIAS = "claude-local"  # what --model / ANTHROPIC_MODEL names
FAST_ALIAS = "claude-local-fast"  # what its small/fast model (ANTHROPIC_DEFAULT_HAIKU_MODEL) names
CLAUDE_USER_ID = json.dumps({"device_id": "1a2e" * 16, "account_uuid": "",
                             "session_id": "c1940f2a-56df-466f-81c7-9cc552787cf0"}, separators=(",", ":"))
REMINDER = "<system-reminder>\nToday's date is 2026-12-02.\n</system-reminder>\n\n"
AGENTS_NOTE = "Available agent types for the Agent tool:\n- claude: Catch-all."
BASH = {"name": "Bash", "description": "Executes a bash command and returns its output.",
        "input_schema": {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
                         "properties": {"command": {"type": "string", "description": "The command"},
                                        "timeout": {"type": "number", "minimum": 0, "maximum": 600000}},
                         "required": ["command"], "additionalProperties": False}}
CLAUDE_CODE_BODY: dict[str, Any] = {
    "model": MAIN_ALIAS, "max_tokens": 32000, "stream": True,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
               {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": REMINDER},
                                              {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                 {"role": "system", "content": AGENTS_NOTE}],
    "tools": [BASH],
    "metadata": {"user_id": CLAUDE_USER_ID},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
}
"""What ``claude -p hi`` (2.1.197) sends, condensed: its fields and their shapes, fewer and shorter texts and tools."""


# -- the pure translation of Claude Code's request -----------------------------------------------------------------


def test_claude_codes_request_is_accepted() -> None:
    request = schema.messages_request(CLAUDE_CODE_BODY)
    system = "x-anthropic-billing-header: cc_version=2.1.197;You are a Claude agent."
    assert request.messages == (Message("system", system), Message("user", f"{REMINDER}hi\n\n{AGENTS_NOTE}"))
    assert (request.model, request.stream, request.max_tokens) == (MAIN_ALIAS, True, 32000)
    assert [tool.name for tool in request.tools] == ["Bash"]
    assert request.user is None  # its user_id describes a device and a session, not an agent
    named = schema.messages_request({**CLAUDE_CODE_BODY, "metadata": {"user_id": "agent-7"}})
    assert named.user == "agent-7"


@pytest.mark.parametrize(("messages", "wanted"), [
    ([{"role": "system", "content": "S2"}, {"role": "user", "content": "U"}],
     (Message("system", "S\n\nS2"), Message("user", "U"))),
    ([{"role": "user", "content": "U"}, {"role": "system", "content": [{"type": "text", "text": "S2"}]}],
     (Message("system", "S"), Message("user", "U\n\nS2"))),
    ([{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}, {"role": "system", "content": "S2"}],
     (Message("system", "S"), Message("user", "U"), Message("assistant", "A"), Message("user", "S2"))),
    ([{"role": "user", "content": "U"}, {"role": "system", "content": ""}],
     (Message("system", "S"), Message("user", "U"))),
])
def test_a_system_message_inside_messages_is_folded_into_the_turn_beside_it(
        messages: list[dict[str, Any]], wanted: tuple[Message, ...]) -> None:
    request = schema.messages_request({"model": "m", "max_tokens": 8, "system": "S", "messages": messages})
    assert request.messages == wanted


def test_a_system_message_first_without_a_system_prompt_is_the_system_prompt() -> None:
    request = schema.messages_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert request.messages == (Message("system", "S"), Message("user", "U"))


@pytest.mark.parametrize("thinking", [{"type": "adaptive"}, {"type": "enabled", "budget_tokens": 2048},
                                      {"type": "disabled"}, {"type": "adaptive", "display": "summarized"}])
def test_thinking_is_accepted_as_no_extended_thinking(thinking: dict[str, Any]) -> None:
    request = schema.messages_request({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "U"}],
                                       "thinking": thinking})
    assert request.messages == (Message("user", "U"),)


def test_an_earlier_thinking_block_is_dropped_from_the_history() -> None:
    request = schema.messages_request({"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "sig"},
                                          {"type": "redacted_thinking", "data": "xx"},
                                          {"type": "text", "text": "A"}]},
        {"role": "user", "content": "V"}]})
    assert request.messages == (Message("user", "U"), Message("assistant", "A"), Message("user", "V"))


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"thinking": {"type": "sometimes"}}, "thinking.type", "adaptive"),
    ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking.budget_tokens", "integer"),
    ({"thinking": {"type": "adaptive", "extra": 1}}, "thinking.extra", "unknown field"),
    ({"thinking": "on"}, "thinking", "an object"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort", "low"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format", "response_format"),
    ({"output_config": []}, "output_config", "an object"),
    ({"context_management": {"edits": "all"}}, "context_management.edits", "a list"),
    ({"context_management": {"other": []}}, "context_management.other", "unknown field"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id", "a string"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type",
     "images are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
     "messages[0].content[0].type", "a user message takes text and tool_result blocks"),
])
def test_a_bad_claude_code_field_is_a_bad_request_naming_it(fields: dict[str, Any], param: str, says: str) -> None:
    given = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "U"}], **fields}
    with pytest.raises(ApplianceError) as caught:
        schema.messages_request(given)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details["param"] == param
    assert says in caught.value.message


CODEX_EXEC = {"type": "function", "name": "exec_command", "strict": False,
              "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                             "additionalProperties": False}}
CODEX_CLOSE_AGENT = {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
                     "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                                    "required": ["target"], "additionalProperties": False}}
CODEX_METADATA = json.dumps({"session_id": "01a23422", "sandbox_mode": "read-only", "model": CODEX_ALIAS})
CODEX_BODY: dict[str, Any] = {
    "model": CODEX_ALIAS, "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a23422",
    "client_metadata": {"thread_id": "01a23422", "x-codex-turn-metadata": CODEX_METADATA},
    "input": [{"type": "message", "id": "msg_f184", "role": "developer",
               "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
              {"type": "message", "id": "msg_01a2", "role": "developer",
               "content": [{"type": "input_text", "text": "<skills_instructions>\n"},
                           {"type": "input_text", "text": "<permissions instructions>\n"}]},
              {"type": "message", "id": "msg_01a3", "role": "user",
               "content": [{"type": "input_text", "text": "<environment_context/>"}]},
              {"type": "message", "id": "msg_01a4", "role": "user",
               "content": [{"type": "input_text", "text": "say hi"}]}],
    "tools": [CODEX_EXEC,
              {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
               "tools": [CODEX_CLOSE_AGENT]},
              {"type": "web_search", "external_web_access": False}],
}
"""What ``codex exec "say hi"`` (0.171.0) sends, condensed: its fields and their shapes, fewer and shorter texts and
tools."""


def test_codexs_request_is_accepted() -> None:
    request = responses_schema.responses_request(CODEX_BODY)
    assert request.input == (Message("developer", "You are a coding agent running in the Codex CLI."),
                             Message("developer", "<skills_instructions>\n<permissions instructions>\n"),
                             Message("user", "<environment_context/>"), Message("user", "say hi"))
    assert [tool.name for tool in request.tools] == ["exec_command", "multi_agent_v1__close_agent"]
    assert (request.options.model, request.options.stream, request.store) == (CODEX_ALIAS, True, False)
    assert request.tool_choice == "auto" and request.instructions is None
    output = responses_schema.Output(namespaced=request.namespaced)
    output.feed([toolcalls.CallStart(0, "call_1", "multi_agent_v1__close_agent"),
                 toolcalls.CallArguments(0, '{"target": "a1"}')])
    output.finish(incomplete=False)
    call = output.items[0]
    assert (call["type"], call["namespace"], call["name"]) == ("function_call", "multi_agent_v1", "close_agent")


# -- Claude Code itself ----------------------------------------------------------------------------------------------

MODEL = "tiny-qwen"  # the model's own name: the CLIs know only its aliases
N_CTX = 32768  # Claude Code's prompt (its system prompt and 24 tools) is about 20k tokens, Codex's about 10k
MAX_OUTPUT_TOKENS = 64  # CLAUDE_CODE_MAX_OUTPUT_TOKENS: Claude Code fails an answer cut short by it
ANSWER = "Hi from the appliance."
ANSWER_GRAMMAR = Grammar(f'root ::= "{ANSWER}"')
"""Random weights never end a turn by themselves (and Claude Code fails an answer cut short by its output limit): the
test's requests get a grammar (as a ``response_format`` would) that spells :data:`ANSWER`, after which only the
end-of-turn token is allowed, so each answer is short, whole and known."""
INSTALL_TIMEOUT_S = 300
RUN_TIMEOUT_S = 100


def npm_cache(name: str, version: str) -> Path:
    """Where an npm package is installed once per machine (it survives between runs, so CI downloads it once)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "appliance" / "npm" / f"{name}-{version}"


def npm_installed(package: str, version: str, folder: Path, command: str) -> Path:
    """``folder/node_modules/.bin/<command>`` of ``package@version``, installed there by npm unless it already is;
    the test is skipped, with npm's own words, when npm is missing or cannot install it."""
    binary = folder / "node_modules" / ".bin" / command
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed, so {package} cannot be")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder),
                               f"{package}@{version}"], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm install {package}@{version} took over {INSTALL_TIMEOUT_S} s (is the registry reachable?)")
    if done.returncode != 0 or not binary.exists():
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        pytest.skip(f"npm install {package}@{version} failed ({done.returncode}): {' | '.join(said)}")
    return binary


@pytest.fixture(scope="module")
def claude() -> Path:
    return npm_installed(CLAUDE_CODE, CLAUDE_CODE_VERSION, npm_cache("claude-code", CLAUDE_CODE_VERSION), "claude")


@pytest.fixture(scope="module")
def long_context_model(vendored: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer, 64-wide random-weight model with Qwen2.5's tokenizer and chat template, trained (so its GGUF says)
    on :data:`N_CTX` tokens."""
    from vendored import template_path, vocab_path

    from appliance.engine.tinymodel import write_tiny_model

    case = CASES["qwen2.5"]
    template = template_path(vendored, case.template).read_text(encoding="utf-8")
    return write_tiny_model(tmp_path_factory.mktemp("agent-cli") / "qwen-long.gguf", layers=2, dim=64,
                            n_ctx_train=N_CTX, vocab_from=vocab_path(vendored, case.vocab), chat_template=template,
                            special_tokens=case.special_tokens)


@pytest.fixture(scope="module")
def app(long_context_model: Path) -> Iterator[Running]:
    specs = {MODEL: {"path": str(long_context_model), "n_ctx": N_CTX,
                     "aliases": [MAIN_ALIAS, FAST_ALIAS, CODEX_ALIAS]}}
    with running(specs, model_dirs=[long_context_model.parent]) as running_app:
        yield running_app


def claude_environment(home: Path, base_url: str) -> dict[str, str]:
    """Claude Code's environment: a fresh HOME, the appliance as its API, aliases as its models, nothing else
    reached (telemetry, updates, non-essential traffic off)."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TERM": "dumb",
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "local", "ANTHROPIC_MODEL": MAIN_ALIAS,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": FAST_ALIAS, "ANTHROPIC_SMALL_FAST_MODEL": FAST_ALIAS,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1"}


def known_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Anthropic request of this test answers :data:`ANSWER` (:data:`ANSWER_GRAMMAR`)."""
    translate = schema.messages_request

    def answering(body: dict[str, Any], *, counting: bool = False) -> Any:
        return dataclasses.replace(translate(body, counting=counting), response_grammar=ANSWER_GRAMMAR)

    monkeypatch.setattr(schema, "messages_request", answering)


def test_claude_code_prints_a_streamed_answer_through_an_alias(claude: Path, app: Running, long_context_model: Path,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    known_answers(monkeypatch)
    home = tmp_path / "home"
    home.mkdir()
    url = app.appliance.http_url
    assert url is not None
    started = time.monotonic()
    done = subprocess.run([str(claude), "-p", "Say hi.", "--model", MAIN_ALIAS], cwd=tmp_path, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env=claude_environment(home, url))
    elapsed = time.monotonic() - started
    assert done.returncode == 0, f"claude -p exited {done.returncode}: {done.stderr[-2000:]}{done.stdout[-2000:]}"
    served = [record for record in app.daemon.requests.recent(50) if record.surface == "anthropic"]
    assert ANSWER in done.stdout, f"claude -p printed {done.stdout[-500:]!r} (stderr: {done.stderr[-2000:]}; {served})"
    assert served, "the appliance recorded no Anthropic request"
    assert all(record.model == MODEL and record.outcome == "ok" for record in served), served
    assert max(record.prompt_tokens for record in served) > 5000  # Claude Code's own prompt, not a stand-in
    assert 0 < max(record.generated_tokens for record in served) <= MAX_OUTPUT_TOKENS
    assert elapsed < RUN_TIMEOUT_S


# -- Codex itself -----------------------------------------------------------------------------------------------------

CODEX_RUN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def codex() -> Path:
    return npm_installed(CODEX, CODEX_VERSION, npm_cache("codex", CODEX_VERSION), "codex")


def codex_home(home: Path, base_url: str) -> Path:
    """``$CODEX_HOME`` with a ``config.toml`` whose model is :data:`CODEX_ALIAS`, served by the appliance's Responses
    API (``base_url`` is its ``/v1``); its key is read from ``APPLIANCE_KEY``."""
    folder = home / ".codex"
    folder.mkdir(parents=True)
    config = (f'model = "{CODEX_ALIAS}"\nmodel_provider = "appliance"\n\n[model_providers.appliance]\n'
              f'name = "appliance"\nbase_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "APPLIANCE_KEY"\n')
    (folder / "config.toml").write_text(config, encoding="utf-8")
    return folder


def responses_known_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Responses request of this test answers :data:`ANSWER` (:data:`ANSWER_GRAMMAR`)."""
    translate = responses_schema.responses_request

    def answering(body: dict[str, Any]) -> responses_schema.ResponsesRequest:
        checked = translate(body)
        options = dataclasses.replace(checked.options, response_grammar=ANSWER_GRAMMAR)
        return dataclasses.replace(checked, options=options)

    monkeypatch.setattr(responses_schema, "responses_request", answering)


def test_codex_exec_prints_a_streamed_answer_through_an_alias(codex: Path, app: Running, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    responses_known_answers(monkeypatch)
    home = tmp_path / "home"
    work = tmp_path / "work"
    work.mkdir()
    url = app.appliance.http_url
    assert url is not None
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "TERM": "dumb",
                   "CODEX_HOME": str(codex_home(home, url)), "APPLIANCE_KEY": "local"}
    started = time.monotonic()
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", "--sandbox", "read-only", "Say hi."],
                          cwd=work, capture_output=True, text=True, timeout=CODEX_RUN_TIMEOUT_S, env=environment,
                          stdin=subprocess.DEVNULL)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, f"codex exec exited {done.returncode}: {done.stderr[-2000:]}{done.stdout[-2000:]}"
    served = [record for record in app.daemon.requests.recent(50) if record.surface == "responses"]
    assert ANSWER in done.stdout, f"codex exec printed {done.stdout[-500:]!r} (stderr: {done.stderr[-2000:]}; {served})"
    assert served, "the appliance recorded no Responses request"
    assert all(record.model == MODEL and record.outcome == "ok" for record in served), served
    assert max(record.prompt_tokens for record in served) > 3000  # Codex's own prompt (4.5k tokens), not a stand-in
    assert elapsed < CODEX_RUN_TIMEOUT_S

"""The agent session (SPEC B1): a seeded multi-turn workload of several agents at once, run against an appliance
over its OpenAI API, and the figures of the seed's table. ``appliance benchmark`` and ``benchmarks/agent_session.py``
both run it.

The workload: ``agents`` agents at once, each its own conversation, for ``rounds`` rounds. In a round every agent
sends its turn at the same time (``POST /v1/completions``, streamed, greedy, ``user`` naming its conversation, the
whole history re-sent as OpenAI clients do: the appliance decodes only the new text) and the next round starts when
all have answered. A turn adds a tool result or user turn of random text (common English words, one token each in
the tiny models' vocabulary, seeded) and asks for a short tool call (``max_tokens`` 16) or a long answer (128). When a
conversation would pass the model's ``n_ctx`` (its answers counted at most: :meth:`AgentState.answered`) the agent
starts a new one (a new ``user``) and unregisters the one it left, as a client would.

Figures: TTFT (client side: request sent to first streamed text) average and P99 over every turn; tokens/s =
generated tokens / the rounds' wall time; peak memory = the appliance process's VmHWM at the end; memory growth =
VmRSS at the end - VmRSS after round 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from appliance.client.lines import request as line_request
from appliance.errors import ApplianceError
from appliance.protocol.identifiers import user_agent_id

SHORT_OUTPUT = 16
"""``max_tokens`` of a tool call."""
LONG_OUTPUT = 128
"""``max_tokens`` of a long answer."""
SESSION_INPUT = (50, 600)
TOOL_PHASE_INPUT = (50, 100)
DOCUMENT_PHASE_INPUT = (400, 600)
ROLLOVER_MARGIN = 16
"""Tokens kept free when deciding whether a turn still fits its conversation (the input's token count is the
number of its words; a margin covers a tokenizer that splits one)."""
REQUEST_TIMEOUT_S = 900.0
WARMING_TIMEOUT_S = 600.0
WARMUP_PROMPT = "Hello world, this is a warm up"
WARMUP_TOKENS = 4
CHOICE_KEYS = ("pool_cells", "plan", "threads", "cold_cells", "pool_bytes", "cold_bytes", "adaptive")
"""The keys of a ``/v1/health`` ``contexts`` record kept per round: what the engine chose."""
_PROMPT_WORD_TEXT = """
the of and to a in is it you that he was for on are with as they be at one have this from or had by hot word but
what some we can out other were all there when up use your how said an each she which do their time if will way about
many then them write would like so these her long make thing see him two has look more day could go come did number
"""
PROMPT_WORDS = tuple(_PROMPT_WORD_TEXT.split())
"""Whole words of the tiny models' vocabulary: one token each (the prompts are checked with the tokenizer)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def completion_chunks(http: httpx.Client, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """POST a streamed ``/v1/completions`` and yield each SSE data chunk until ``[DONE]``; an answer other than 200
    or an error event raises ``RuntimeError``."""
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {' '.join(response.text.split())[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            yield chunk


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """The text a completion chunk carries ("" for a usage-only chunk)."""
    choices = chunk.get("choices") or []
    return (choices[0].get("text") or "") if choices else ""


# -- the workload --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """What one agent sends in one round: ``text`` (the tool result or user turn, ``input_tokens`` words of one
    token each) and the ``max_tokens`` it asks for."""

    input_tokens: int
    max_tokens: int
    text: str


@dataclass(frozen=True)
class Phase:
    """Rounds ``first`` up to (not including) ``end`` of a workload."""

    name: str
    first: int
    end: int


@dataclass(frozen=True)
class Workload:
    """Every turn, ``turns[round][agent]``, and the phases measured on their own."""

    name: str
    description: str
    turns: list[list[Turn]]
    phases: tuple[Phase, ...]


def input_text(rng: random.Random, n_tokens: int) -> str:
    """``n_tokens`` random words of the tiny vocabulary (one token each), as text appended to a conversation."""
    return " " + " ".join(rng.choice(PROMPT_WORDS) for _ in range(n_tokens))


def turn(rng: random.Random, inputs: tuple[int, int], max_tokens: int) -> Turn:
    n_tokens = rng.randint(*inputs)
    return Turn(n_tokens, max_tokens, input_text(rng, n_tokens))


def session_workload(agents: int, rounds: int, seed: int) -> Workload:
    """The plain session: inputs of 50-600 tokens, a tool call or a long answer with even odds."""
    rng = random.Random(seed)
    turns = [[turn(rng, SESSION_INPUT, rng.choice((SHORT_OUTPUT, LONG_OUTPUT))) for _ in range(agents)]
             for _ in range(rounds)]
    return Workload("session", f"{agents} agents x {rounds} rounds, inputs {SESSION_INPUT[0]}-{SESSION_INPUT[1]} "
                    f"tokens, outputs {SHORT_OUTPUT} or {LONG_OUTPUT} tokens (even odds)", turns,
                    (Phase("all", 0, rounds),))


def phase_shift_workload(agents: int, rounds: int, seed: int) -> Workload:
    """The first half of the rounds short tool calls, the second half long documents."""
    rng = random.Random(seed + 1)
    half = rounds // 2
    turns = []
    for index in range(rounds):
        if index < half:
            turns.append([turn(rng, TOOL_PHASE_INPUT, SHORT_OUTPUT) for _ in range(agents)])
        else:
            turns.append([turn(rng, DOCUMENT_PHASE_INPUT, LONG_OUTPUT) for _ in range(agents)])
    return Workload("phase_shift", f"{agents} agents; rounds 1-{half}: tool calls (inputs {TOOL_PHASE_INPUT[0]}-"
                    f"{TOOL_PHASE_INPUT[1]} tokens, {SHORT_OUTPUT} out); rounds {half + 1}-{rounds}: documents "
                    f"(inputs {DOCUMENT_PHASE_INPUT[0]}-{DOCUMENT_PHASE_INPUT[1]}, {LONG_OUTPUT} out)", turns,
                    (Phase("tool_calls", 0, half), Phase("documents", half, rounds)))


# -- the appliance under test -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Strategy:
    """How the appliance runs: its ``engine:`` keys and the model's ``n_ctx``."""

    name: str
    label: str
    engine: dict[str, Any]
    n_ctx: int


def llama_cpp_default_threads() -> int:
    """llama-cpp-python's default ``n_threads`` (``Llama()``): half the CPUs, at least 1."""
    return max(1, (os.cpu_count() or 1) // 2)


def fixed_strategy(n_ctx: int) -> Strategy:
    threads = llama_cpp_default_threads()
    return Strategy("fixed", f"engine.adaptive false, threads {threads} (llama-cpp-python's default), batch 512, "
                    f"n_ctx {n_ctx} preallocated", {"adaptive": False, "threads": threads}, n_ctx)


def adaptive_strategy(n_ctx: int) -> Strategy:
    return Strategy("adaptive", f"engine.adaptive true, engine defaults, model n_ctx {n_ctx}", {"adaptive": True},
                    n_ctx)


@dataclass(frozen=True)
class Served:
    """An appliance under test: where it answers (HTTP, and its line-protocol socket), its process id, its log, and
    the model the session asks for."""

    base_url: str
    socket: Path
    pid: int | None  # None: its memory cannot be read (figures None)
    log: Path
    model: str

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def proc_status_bytes(pid: int, key: str) -> int:
    """A ``kB`` line of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {key} line")


def health(base_url: str) -> dict[str, Any]:
    response = httpx.get(base_url + "/v1/health", timeout=10)
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def warming(document: dict[str, Any]) -> bool:
    engine = document.get("engine") or {}
    return bool(engine.get("warming", False))


def warm_up(served: Served) -> None:
    """One untimed stateless request (the model loaded), then wait while the engine says ``warming``."""
    body = {"model": served.model, "prompt": WARMUP_PROMPT, "max_tokens": WARMUP_TOKENS, "temperature": 0.0}
    response = httpx.post(served.base_url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    if response.status_code != 200:
        raise RuntimeError(f"warm-up request failed: HTTP {response.status_code} {response.text[:300]}\n"
                           f"server log:\n{served.tail()}")
    deadline = time.monotonic() + WARMING_TIMEOUT_S
    while warming(health(served.base_url)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the appliance still says warming after {WARMING_TIMEOUT_S:.0f} s")
        time.sleep(0.2)


# -- running a session ---------------------------------------------------------------------------------------------


@dataclass
class TurnResult:
    """One agent's turn as the client saw it (times from ``time.perf_counter``)."""

    agent: int
    round: int
    user: str
    input_tokens: int
    max_tokens: int
    sent: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    usage: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.sent) * 1e3


@dataclass
class AgentState:
    """An agent's current conversation: its number, the text it holds and its tokens."""

    index: int
    conversation: int = 0
    history: str = ""
    held_tokens: int = 0
    rollovers: int = 0
    abandoned: list[str] = field(default_factory=list)  # conversations left behind, not unregistered yet
    prefix: str = ""  # before every conversation's name: apart from other clients' on a shared appliance

    @property
    def user(self) -> str:
        return f"{self.prefix}agent{self.index}-conv{self.conversation}"

    def prompt_for(self, step: Turn, n_ctx: int) -> str:
        """The prompt of ``step``: the history and the new text; a new conversation when it would pass ``n_ctx``."""
        if self.history and self.held_tokens + step.input_tokens + step.max_tokens + ROLLOVER_MARGIN > n_ctx:
            self.abandoned.append(self.user)
            self.conversation += 1
            self.history = ""
            self.held_tokens = 0
            self.rollovers += 1
        return self.history + step.text

    def answered(self, prompt: str, result: TurnResult) -> None:
        """The conversation now holds ``prompt`` and the answer. Its tokens as the next turn re-sends them are
        counted at most: the answer's text may tokenize into more tokens than were generated (random weights write
        pieces that re-tokenize apart), never into more than its UTF-8 bytes."""
        self.history = prompt + result.text
        self.held_tokens = result.prompt_tokens + max(result.completion_tokens, len(result.text.encode("utf-8")))


def stream_turn(http: httpx.Client, model: str, prompt: str, result: TurnResult) -> None:
    """Stream one turn into ``result``: first and last text, the text, the usage chunk's counts."""
    body = {"model": model, "prompt": prompt, "max_tokens": result.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "user": result.user}
    parts: list[str] = []
    try:
        result.sent = time.perf_counter()
        for chunk in completion_chunks(http, body):
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            text = chunk_text(chunk)
            if not text:
                continue
            now = time.perf_counter()
            if result.first_token is None:
                result.first_token = now
            result.last_token = now
            parts.append(text)
    except Exception as exc:  # recorded per turn; the run reports it and exits 1
        result.error = f"{type(exc).__name__}: {exc}"
    result.text = "".join(parts)
    if result.error is None and not result.usage:
        result.error = "the stream ended without a usage chunk"
    if result.usage:
        result.completion_tokens = int(result.usage.get("completion_tokens", 0))
        result.prompt_tokens = int(result.usage.get("prompt_tokens", 0))
        details = result.usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens", 0))


@dataclass
class RoundSample:
    """One round: its wall time, then the server's memory and what its engine chose."""

    round: int
    wall_s: float
    rss_bytes: int | None
    hwm_bytes: int | None
    contexts: list[dict[str, Any]]
    engine: dict[str, Any]
    agents_registered: int


def unregister(served: Served, user: str) -> None:
    """Unregister a conversation its agent left (line protocol ``UNREGISTER`` of the user's agent on the model,
    ``<user>@<model>``): done after the round in which the agent's new conversation registered, so the model always
    keeps an agent."""
    agent = user_agent_id(user, served.model)
    reply = line_request(served.socket, f"UNREGISTER {agent}", timeout=60)
    if not reply.startswith("OK"):
        raise RuntimeError(f"UNREGISTER {agent} failed: {reply.strip()}")


def choices_of(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [{key: record.get(key) for key in ("model", *CHOICE_KEYS) if key in record}
            for record in document.get("contexts", [])]


RoundDone = Callable[[int], None]
"""Called with the number of rounds done after each round (a progress bar)."""


def ignore_round(done: int) -> None:
    """The default :data:`RoundDone`: nothing to tell."""


def run_session(served: Served, workload: Workload, n_ctx: int, on_round: RoundDone = ignore_round,
                prefix: str = "") -> tuple[list[TurnResult], list[RoundSample], list[AgentState]]:
    """The workload's rounds against ``served``: every agent's turn at once (one keep-alive connection per agent),
    then the round's sample. The conversations still registered at the end are unregistered, so the appliance
    keeps nothing of the session."""
    n_agents = len(workload.turns[0])
    agents = [AgentState(index, prefix=prefix) for index in range(n_agents)]
    results: list[TurnResult] = []
    samples: list[RoundSample] = []
    clients = [httpx.Client(base_url=served.base_url, timeout=REQUEST_TIMEOUT_S) for _ in agents]
    try:
        for round_index, steps in enumerate(workload.turns):
            prompts = [agent.prompt_for(step, n_ctx) for agent, step in zip(agents, steps, strict=True)]
            turn_results = [TurnResult(agent.index, round_index, agent.user, step.input_tokens, step.max_tokens)
                            for agent, step in zip(agents, steps, strict=True)]
            threads = [threading.Thread(target=stream_turn, args=(client, served.model, prompt, result),
                                        daemon=True)
                       for client, prompt, result in zip(clients, prompts, turn_results, strict=True)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(REQUEST_TIMEOUT_S + 30)
            for agent, prompt, result in zip(agents, prompts, turn_results, strict=True):
                agent.answered(prompt, result)
                for user in agent.abandoned:
                    unregister(served, user)
                agent.abandoned.clear()
            results.extend(turn_results)
            ends = [r.last_token or r.sent for r in turn_results]
            wall = max(ends) - min(r.sent for r in turn_results)
            document = health(served.base_url)
            rss = None if served.pid is None else proc_status_bytes(served.pid, "VmRSS")
            hwm = None if served.pid is None else proc_status_bytes(served.pid, "VmHWM")
            samples.append(RoundSample(round_index, wall, rss, hwm, choices_of(document),
                                       document.get("engine") or {}, int(document.get("agents", 0))))
            if any(r.error is not None for r in turn_results):
                break  # the conversations no longer follow the workload: figures would not compare
            on_round(round_index + 1)
    finally:
        for client in clients:
            client.close()
        forget(served, agents, results)
    return results, samples, agents


def forget(served: Served, agents: Sequence[AgentState], results: Sequence[TurnResult]) -> None:
    """Unregister every conversation of the session still registered (those that answered at least once)."""
    answered = {result.user for result in results if result.usage}
    for agent in agents:
        for user in [*agent.abandoned, agent.user]:
            if user in answered:
                with contextlib.suppress(RuntimeError, OSError, ApplianceError):
                    unregister(served, user)


def figures(results: Sequence[TurnResult], samples: Sequence[RoundSample], first: int, end: int) -> dict[str, Any]:
    """TTFT average and P99 (ms), tokens/s, peak memory and memory growth over rounds ``first`` to ``end``."""
    turns = [r for r in results if first <= r.round < end]
    rounds = [s for s in samples if first <= s.round < end]
    ttft = [r.ttft_ms for r in turns if r.ttft_ms is not None]
    wall = sum(s.wall_s for s in rounds)
    generated = sum(r.completion_tokens for r in turns)
    complete = bool(turns) and len(rounds) == end - first and all(r.error is None for r in turns)
    return {
        "turns": len(turns), "complete": complete, "generated_tokens": generated,
        "prompt_tokens": sum(r.prompt_tokens for r in turns), "cached_tokens": sum(r.cached_tokens for r in turns),
        "wall_s": wall,
        "ttft_avg_ms": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "peak_memory_bytes": rounds[-1].hwm_bytes if rounds else None,
        "memory_growth_bytes": growth(rounds[0].rss_bytes, rounds[-1].rss_bytes) if rounds else None,
        "rss_after_first_round_bytes": rounds[0].rss_bytes if rounds else None,
        "rss_end_bytes": rounds[-1].rss_bytes if rounds else None,
    }




FIGURE_KEYS = ("ttft_avg_ms", "ttft_p99_ms", "tokens_per_s", "peak_memory_bytes", "memory_growth_bytes")
LOWER_IS_BETTER = {"ttft_avg_ms": True, "ttft_p99_ms": True, "tokens_per_s": False, "peak_memory_bytes": True,
                   "memory_growth_bytes": True}
GROWTH_FLOOR_BYTES = 2**20
"""Below this memory growth of the fixed run, a relative improvement means nothing: none is given."""


def median_figures(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repetitions' figures; None when there is none or a repetition lacks it (a
    failed run). Bytes stay whole numbers."""
    out: dict[str, Any] = {}
    for key in FIGURE_KEYS:
        values = [run[key] for run in runs]
        if not values or any(value is None for value in values):
            out[key] = None
            continue
        middle = statistics.median(values)
        out[key] = round(middle) if key.endswith("_bytes") else middle
    return out


def improvement(key: str, fixed: float | None, adaptive: float | None) -> float | None:
    """How much better adaptive is than fixed (a fraction; positive = better): lower for times and memory, higher
    for tokens/s."""
    if fixed is None or adaptive is None or fixed == 0:
        return None
    if key == "memory_growth_bytes" and abs(fixed) < GROWTH_FLOOR_BYTES:
        return None
    if LOWER_IS_BETTER[key]:
        return (fixed - adaptive) / abs(fixed)
    return (adaptive - fixed) / fixed


def growth(first: int | None, last: int | None) -> int | None:
    return None if first is None or last is None else last - first


def round_figures(results: Sequence[TurnResult], samples: Sequence[RoundSample]) -> list[dict[str, Any]]:
    """Each round's TTFT average and maximum (ms), tokens/s, the process's RSS and peak (what the charts draw), and
    the live context's pool cells, plan and threads after it."""
    rows = []
    for sample in samples:
        turns = [r for r in results if r.round == sample.round]
        ttft = [r.ttft_ms for r in turns if r.ttft_ms is not None]
        generated = sum(r.completion_tokens for r in turns)
        context = sample.contexts[0] if sample.contexts else {}
        rows.append({"round": sample.round + 1,
                     "ttft_avg_ms": statistics.fmean(ttft) if ttft else None,
                     "ttft_max_ms": max(ttft) if ttft else None,
                     "tokens_per_s": generated / sample.wall_s if sample.wall_s > 0 else None,
                     "rss_bytes": sample.rss_bytes, "hwm_bytes": sample.hwm_bytes,
                     "pool_cells": context.get("pool_cells"), "plan": context.get("plan"),
                     "threads": context.get("threads")})
    return rows


def max_in_flight(results: Sequence[TurnResult]) -> int:
    """The most turns that were in flight at once (request sent to last token, as the client saw them)."""
    events: list[tuple[float, int]] = []
    for result in results:
        end = result.last_token if result.last_token is not None else result.sent
        events.append((result.sent, 1))
        events.append((end, -1))
    events.sort(key=event_order)
    most = 0
    now = 0
    for _, change in events:
        now += change
        most = max(most, now)
    return most


def event_order(event: tuple[float, int]) -> tuple[float, int]:
    """Ends before starts at the same instant: a turn that ended as another began was not beside it."""
    return event[0], event[1]

"""Durable agents (issue #24): what a ``kill -9``, a SIGTERM, a full host KV budget, a bad KV file, a corrupt store or
a full disk must not lose.

Real ``appliance run`` processes (tests/hostile/durable_run.py) where restarts are involved, the in-process harness
where one appliance is enough; real tiny models throughout.

**References.** A conversation is held to a reference that went the same way without the fault: a fresh agent that
replays its turns (line protocol; OpenAI agents: a fresh ``user`` agent sent the same requests, or a stateless
request of the same history). The tiny models have random weights, so their logits nearly tie at many steps, and a
state computed another way (its tokens re-evaluated in one batch, against one built token by token) moves a logit by
up to ~5e-4 (tests/test_batched.py, tests/test_engine_v2.py): enough to flip a greedy token at a near-tie. So every
continuation is compared with a reference whose state was computed the same way (both restored from disk, both
re-evaluated from their tokens), and the kill case compares the store's tokens themselves with the replay's, exactly.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from durable_run import Run, Runs, corrupt_files, decode_text, state_folder, stored_tokens, strays, write_config
from harness import running
from hostile_checks import HUNG_S

from appliance.client import lines as lineclient
from appliance.daemon import kvfiles, statefiles
from appliance.protocol.identifiers import user_agent_id

WORDS = ("the water of time", "a long day", "people call first", "what some can do", "how many write", "sound no",
         "look more", "go come", "down side", "number one")


def decode(app: Any, agent: str, n_tokens: int, prompt: str = "") -> tuple[str, dict[str, str]]:
    """One DECODE: its text and its header fields."""
    reply = app.line(f"DECODE {agent} {n_tokens} {prompt}".rstrip(), timeout=120)
    return decode_text(reply), lineclient.header_fields(reply)


# -- 1. kill -9 at random points ------------------------------------------------------------------------------------

KILLS = 15
LINE_AGENTS = ("la0", "la1", "la2", "la3", "la4")  # five: a replay takes another token at a near-tie in about half
HTTP_AGENTS = ("ua0", "ua1")
TURN_TOKENS = 6
TURNS_PER_ROUND = 30  # per agent and round: more than fit in the longest kill delay, so that a kill finds turns left
TURN_GAP_S = (0.02, 0.12)
KILL_DELAY_S = (0.05, 1.5)
KILL_WAIT_S = 5.0  # after the delay, the kill waits at most this for a request in flight
LINE_TOKEN_CEILING = 1600  # of model a's n_ctx 2048: no new turn past it (the final checks add a few)
HTTP_TOKEN_CEILING = 3200  # of model b's n_ctx 4096
SEED = 24


@dataclass
class LineTurn:
    prompt: str
    acked: bool  # False: in flight at a kill, and found committed after the restart
    tokens_after: int  # the conversation's tokens after it (the reply's counts; or STATUS after the restart)
    text: str | None = None  # the reply's text, when acknowledged


@dataclass
class LineAgent:
    id: str
    turns: list[LineTurn] = field(default_factory=list)
    tokens: int = 0  # what the store must hold: the acknowledged turns', and the committed in-flight ones'
    inflight: str | None = None  # the prompt of a turn sent and not acknowledged
    unacked_applied: int = 0  # in-flight turns committed before the kill cut their reply
    lost_inflight: int = 0  # in-flight turns the kill stopped before their commit

    @property
    def reference(self) -> str:
        return f"ref-{self.id}"


@dataclass
class HttpAgent:
    id: str
    history: list[dict[str, str]] = field(default_factory=list)  # as the client saw it (acknowledged turns)
    retry: list[dict[str, str]] | None = None  # the messages of a turn not acknowledged: sent again next
    committed: int = 0  # the conversation's tokens as last known committed (an ack, or STATUS after a restart)
    inflight: str | None = None  # the key of the messages in flight when the daemon was killed
    checks: list[tuple[int, int, str]] = field(default_factory=list)  # (STATUS tokens, committed before, inflight)


def listed_as(status: dict[str, dict[str, str]], user: str, model: str) -> str | None:
    """The id STATUS lists an OpenAI ``user``'s agent on ``model`` under (``<user>@<model>``, or the user itself),
    or None."""
    for ident in (user_agent_id(user, model), user):
        if ident in status:
            return ident
    return None


def messages_key(messages: list[dict[str, str]]) -> str:
    return json.dumps(messages, sort_keys=True)


class Round:
    """One run's clients: each agent's thread decodes turn after turn (a short random gap between them) until the
    daemon dies, its turns of this round are done or its conversation is long enough."""

    def __init__(self, run: Run, number: int, seen: dict[str, tuple[int, int]]) -> None:
        self.run = run
        self.number = number
        self.seen = seen  # OpenAI messages key -> (prompt_tokens, completion_tokens) of an acknowledged turn
        self.first_ack = threading.Event()
        self.busy: set[str] = set()  # the agents with a request sent and its reply not yet read whole
        self.sends: list[float] = []  # when each request of the round was sent
        self.turn_s: list[float] = []  # each acknowledged line turn's time, request sent to reply read
        self.stop = threading.Event()  # no new turn: the kill comes
        self.errors: list[str] = []

    def kill_in_flight(self, rng: random.Random) -> None:
        """SIGKILL the daemon a random fraction of a turn into a request sent after this call (waiting at most
        :data:`KILL_WAIT_S` for one): up to half the round's median acknowledged line turn, so that the kill falls
        inside a turn however fast the box ends one (a fixed 0-10 ms fell after it on a fast box)."""
        sent = len(self.sends)
        deadline = time.monotonic() + KILL_WAIT_S
        while (len(self.sends) == sent or not self.busy) and time.monotonic() < deadline:
            time.sleep(0.0005)
        turn_s = statistics.median(self.turn_s) if self.turn_s else 0.01
        time.sleep(rng.uniform(0, 0.5) * turn_s)
        self.stop.set()
        self.run.kill()

    def line_turns(self, agent: LineAgent, rng: random.Random) -> None:
        for turn in range(TURNS_PER_ROUND):
            if agent.tokens > LINE_TOKEN_CEILING or self.stop.is_set():
                return
            prompt = f"{agent.id} r{self.number} t{turn} {rng.choice(WORDS)}"
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(HUNG_S)
                try:
                    sock.connect(str(self.run.sock))
                except OSError:
                    return  # the daemon is gone: this turn was never sent
                agent.inflight = prompt
                self.busy.add(agent.id)
                sent = time.monotonic()
                self.sends.append(sent)
                try:
                    sock.sendall(f"DECODE {agent.id} {TURN_TOKENS} {prompt}\n".encode())
                    reply = lineclient.read_reply(sock.makefile("r", encoding="utf-8", newline="\n"))
                except OSError:
                    return  # cut by the kill: in flight
                finally:
                    self.busy.discard(agent.id)
            if reply.startswith("ERR "):
                agent.inflight = None
                self.errors.append(f"{agent.id}: {reply.strip()}")
                return
            if not reply.rstrip("\n").endswith("END_RESPONSE"):
                return  # cut by the kill: in flight
            self.turn_s.append(time.monotonic() - sent)
            fields = lineclient.header_fields(reply)
            agent.tokens += int(fields["prompt_tokens"]) + int(fields["generated_tokens"])
            agent.turns.append(LineTurn(prompt, True, agent.tokens, lineclient.response_body(reply)))
            agent.inflight = None
            self.first_ack.set()
            time.sleep(rng.uniform(*TURN_GAP_S))

    def http_turns(self, agent: HttpAgent, rng: random.Random) -> None:
        with httpx.Client(timeout=HUNG_S) as client:
            for turn in range(TURNS_PER_ROUND):
                if agent.committed > HTTP_TOKEN_CEILING or self.stop.is_set():
                    return
                messages = agent.retry or [*agent.history, {"role": "user",
                                                            "content": f"r{self.number} t{turn} {rng.choice(WORDS)}"}]
                agent.retry = messages  # until it is acknowledged
                body = {"model": "b", "user": agent.id, "messages": messages, "max_tokens": TURN_TOKENS,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                text: list[str] = []
                usage: dict[str, Any] | None = None
                done = False
                agent.inflight = messages_key(messages)
                self.busy.add(agent.id)
                self.sends.append(time.monotonic())
                try:
                    with client.stream("POST", self.run.url + "/v1/chat/completions", json=body) as response:
                        if response.status_code != 200:
                            agent.inflight = None
                            self.errors.append(f"{agent.id}: HTTP {response.status_code} {response.read()!r}")
                            return
                        for line in response.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line.removeprefix("data: ")
                            if data == "[DONE]":
                                done = True
                                break
                            chunk = json.loads(data)
                            if "error" in chunk:
                                self.errors.append(f"{agent.id}: {chunk}")
                                return
                            usage = chunk.get("usage") or usage
                            for choice in chunk.get("choices", []):
                                text.append(choice.get("delta", {}).get("content") or "")
                except httpx.ConnectError:
                    agent.inflight = None  # never sent
                    return
                except httpx.HTTPError:
                    return  # cut by the kill: in flight
                finally:
                    self.busy.discard(agent.id)
                if not done:
                    return
                assert usage is not None, "a stream with include_usage ended without usage"
                self.seen[messages_key(messages)] = (usage["prompt_tokens"], usage["completion_tokens"])
                agent.history = [*messages, {"role": "assistant", "content": "".join(text)}]
                agent.retry = None
                agent.inflight = None
                agent.committed = usage["prompt_tokens"] + usage["completion_tokens"]
                self.first_ack.set()
                time.sleep(rng.uniform(*TURN_GAP_S))


def all_past_their_ceilings(line_agents: list[LineAgent], http_agents: list[HttpAgent]) -> bool:
    """No agent may start another turn (:data:`LINE_TOKEN_CEILING`, :data:`HTTP_TOKEN_CEILING`): a round would
    acknowledge nothing."""
    return (all(agent.tokens > LINE_TOKEN_CEILING for agent in line_agents)
            and all(agent.committed > HTTP_TOKEN_CEILING for agent in http_agents))


def checked_start(runs: Runs) -> Run:
    """A start on the state folder: the store opened (health ok, no notice, nothing moved aside) and no stray
    file."""
    run = runs.start()
    doc = run.health()
    assert doc["status"] == "ok" and doc["store"]["status"] == "ok" and not doc["notices"], doc
    assert not corrupt_files(run.folder), corrupt_files(run.folder)
    assert not strays(run.folder), strays(run.folder)
    return run


def settle_line_agents(agents: list[LineAgent], status: dict[str, dict[str, str]]) -> None:
    """After a restart: each line agent's stored tokens are its acknowledged turns', plus its in-flight turn's when
    that one was committed before the kill cut its reply (then it is one of its turns from now on)."""
    for agent in agents:
        assert agent.id in status, f"line agent {agent.id} is gone after a restart: {sorted(status)}"
        stored = int(status[agent.id]["tokens"])
        if agent.inflight is not None and stored != agent.tokens:
            assert stored > agent.tokens, (f"{agent.id}: the store holds {stored} tokens, fewer than its "
                                           f"acknowledged turns' {agent.tokens}")
            agent.turns.append(LineTurn(agent.inflight, False, stored))
            agent.tokens = stored
            agent.unacked_applied += 1
        elif agent.inflight is not None:
            agent.lost_inflight += 1
        assert stored == agent.tokens, (f"{agent.id}: the store holds {stored} tokens, its acknowledged turns "
                                        f"{agent.tokens}")
        agent.inflight = None


def settle_http_agents(agents: list[HttpAgent], status: dict[str, dict[str, str]]) -> None:
    """After a restart: an OpenAI agent's stored tokens are its last committed turn's; with a turn in flight at the
    kill they may be that turn's (checked once its count is known: :func:`check_http_agent`)."""
    for agent in agents:
        ident = listed_as(status, agent.id, "b")
        if agent.committed == 0 and ident is None:
            agent.inflight = None
            continue  # its first request never registered it
        assert ident is not None, f"OpenAI agent {agent.id} is gone after a restart: {sorted(status)}"
        stored = int(status[ident]["tokens"])
        if agent.inflight is None:
            assert stored == agent.committed, f"{agent.id}: the store holds {stored} tokens, not {agent.committed}"
        else:
            agent.checks.append((stored, agent.committed, agent.inflight))
        agent.committed = stored
        agent.inflight = None


@dataclass
class Replayed:
    prompt_tokens: int
    generated_tokens: int
    text: str


def replay(run: Run, agent: LineAgent) -> list[Replayed]:
    """A fresh reference agent replays ``agent``'s turns (the same prompts and lengths)."""
    assert run.line(f"REGISTER {agent.reference} a").startswith("OK ")
    replayed = []
    for turn in agent.turns:
        text, fields = decode(run, agent.reference, TURN_TOKENS, turn.prompt)
        replayed.append(Replayed(int(fields["prompt_tokens"]), int(fields["generated_tokens"]), text))
    return replayed


def compare_stored(agent: LineAgent, mine: tuple[int, ...], ref: tuple[int, ...], replayed: list[Replayed]) -> int:
    """Hold ``agent``'s stored tokens to its reference's: equal, turn by turn. Returns how many turns were compared
    (all of them, unless the replay's own greedy generation took another token at a near-tie: a state computed
    another way, not the store; then the turns up to it). Fails on a lost, doubled, half-applied or changed turn."""
    start = 0
    for number, (turn, again) in enumerate(zip(agent.turns, replayed, strict=True)):
        end = start + again.prompt_tokens + again.generated_tokens
        what = "acknowledged" if turn.acked else "committed, its reply cut by the kill"
        prompt_end = start + again.prompt_tokens
        assert mine[start:prompt_end] == ref[start:prompt_end], (
            f"{agent.id} turn {number} ({what}): the store's tokens of its prompt are not the replay's")
        if mine[prompt_end:end] != ref[prompt_end:end]:
            assert not (turn.acked and again.text == turn.text), (
                f"{agent.id} turn {number}: the store holds other generated tokens than the reply its client read "
                f"({turn.text!r}, which the replay generated again)")
            return number  # the replay generated another token at a near-tie: its later turns cannot be compared
        assert end == turn.tokens_after, (
            f"{agent.id} turn {number} ({what}): the conversation held {turn.tokens_after} tokens after it, the "
            f"replay {end}: a lost, doubled or half-applied turn")
        assert not turn.acked or again.text == turn.text, (
            f"{agent.id} turn {number}: the store holds the replay's tokens, but its client read {turn.text!r}, "
            f"not {again.text!r}")
        start = end
    assert len(mine) == start == len(ref), (f"{agent.id}: the store holds {len(mine)} tokens, its "
                                            f"{len(agent.turns)} turns {start}")
    return len(agent.turns)


def check_http_agent(run: Run, agent: HttpAgent, seen: dict[str, tuple[int, int]], listed: bool) -> None:
    """It is still listed; its next turn (its tokens re-evaluated, or its KV state read from a file an earlier spill
    left that still matches a prefix of them) answers as a stateless request of the same history, and the turn after
    finds its history kept (cached tokens); every restart found its store holding its last committed turn or, whole,
    the one in flight at the kill."""
    assert listed, f"OpenAI agent {agent.id} is not in STATUS after the last restart"
    messages = agent.retry or [*agent.history, {"role": "user", "content": "the last turn"}]
    body = {"model": "b", "messages": messages, "max_tokens": TURN_TOKENS, "temperature": 0}
    got = run.chat({**body, "user": agent.id})
    usage = got["usage"]
    assert usage["kv_restored_from"] in (("tokens", "disk") if agent.committed else ("none",)), usage
    seen[messages_key(messages)] = (usage["prompt_tokens"], usage["completion_tokens"])
    stateless = run.chat(body)
    assert got["choices"][0]["message"]["content"] == stateless["choices"][0]["message"]["content"], (got, stateless)
    again = run.chat({**body, "messages": [*messages, got["choices"][0]["message"],
                                           {"role": "user", "content": "and again"}], "user": agent.id})
    # Kept: live, parked, or (an adaptive pool holding its parked states to the fixed strategy's memory) on disk.
    assert again["usage"]["kv_restored_from"] in ("device", "host", "disk"), again["usage"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    for stored, before, inflight in agent.checks:
        if stored == before:
            continue
        assert inflight in seen, (f"{agent.id}: after a kill the store held {stored} tokens, not its last "
                                  f"committed turn's {before}, and the turn in flight was never answered since")
        prompt, completion = seen[inflight]
        assert stored == prompt + completion, (
            f"{agent.id}: after a kill the store held {stored} tokens: neither its last committed turn's {before} "
            f"nor the turn in flight's {prompt} + {completion}: a half-applied turn")


def test_kill_9_at_random_points_loses_no_acknowledged_turn(record_case, tiny_model: Path, tiny_model_b: Path):
    """15 times (fewer once every conversation reached its ceiling): five line agents (model a) and two OpenAI
    ``user`` agents (model b, streamed, the whole history each turn) decode turn after turn in threads; after a
    seeded random 0.05-1.5 s, SIGKILL while a request is in flight; restart on the same folder. Every start opens
    the store (health ok, nothing moved aside, no stray file), and it holds each agent's acknowledged turns, plus
    its turn in flight only when that one was committed whole (STATUS's token count says which). In the end every
    line agent is still registered, its stored tokens are exactly those of a fresh agent replaying its turns (a
    replay that took another token at a near-tie is compared up to it: :func:`compare_stored`; at least one agent
    is compared whole), and (both re-evaluated from their tokens after one more kill, the agents in one start and
    the references in the next) it continues as that reference does; every OpenAI agent is listed and answers as a
    stateless request of its history."""
    rng = random.Random(SEED)
    line_agents = [LineAgent(name) for name in LINE_AGENTS]
    http_agents = [HttpAgent(name) for name in HTTP_AGENTS]
    seen: dict[str, tuple[int, int]] = {}
    crashed = hung = lost = True
    kills_mid_turn = 0
    kills = 0
    with state_folder() as (folder, logs):
        # flash attention off: a replay, decoded alone, must take the very tokens the batched turns took
        models = {"a": {"path": str(tiny_model), "n_ctx": 2048}, "b": {"path": str(tiny_model_b), "n_ctx": 4096}}
        config = write_config(folder, models, engine={"live_slots": 2, "flash_attention": False})
        runs = Runs(config, logs)
        try:
            run = checked_start(runs)
            for agent in line_agents:
                assert run.line(f"REGISTER {agent.id} a").startswith("OK ")
            for kill in range(KILLS + 1):
                if kill:
                    run = checked_start(runs)
                    status = run.agents()
                    settle_line_agents(line_agents, status)
                    settle_http_agents(http_agents, status)
                kills = kill
                if kill == KILLS or all_past_their_ceilings(line_agents, http_agents):
                    break  # a box fast enough took every conversation to its ceiling before the last kill
                rnd = Round(run, kill, seen)
                threads = [threading.Thread(target=rnd.line_turns, args=(agent, random.Random(rng.random())))
                           for agent in line_agents]
                threads += [threading.Thread(target=rnd.http_turns, args=(agent, random.Random(rng.random())))
                            for agent in http_agents]
                for thread in threads:
                    thread.start()
                assert rnd.first_ack.wait(120), f"no turn was acknowledged in round {kill}: {rnd.errors}"
                time.sleep(rng.uniform(*KILL_DELAY_S))
                rnd.kill_in_flight(rng)
                for thread in threads:
                    thread.join(HUNG_S)
                assert not any(thread.is_alive() for thread in threads), "a client hung after the kill"
                assert not rnd.errors, rnd.errors
                kills_mid_turn += any(a.inflight for a in line_agents) or any(a.inflight for a in http_agents)
            crashed = False
            for agent in line_agents:
                assert run.line(f"REGISTER {agent.id} a").startswith("ERR AGENT_EXISTS")
            for agent in http_agents:
                check_http_agent(run, agent, seen, listed_as(status, agent.id, "b") is not None)
            replays = {agent.id: replay(run, agent) for agent in line_agents}
            stored = stored_tokens(folder)
            compared = {agent.id: compare_stored(agent, stored[agent.id], stored[agent.reference],
                                                 replays[agent.id]) for agent in line_agents}
            lost = False
            # The line agents and their references, re-evaluated from their tokens: the agents in one start, the
            # references in the next, in the same order on a pinned engine (the fixed strategy), so that both sides
            # are evaluated in the same cells with the same batches. Decoded in one start, one after the other, the
            # second sat in other cells beside the first: another summation order, and at a near-tie another token.
            write_config(folder, models, engine={"live_slots": 2, "flash_attention": False, "adaptive": False})
            whole = [agent for agent in line_agents if compared[agent.id] == len(agent.turns)]
            continuations: dict[str, list[str]] = {"agents": [], "references": []}
            for side, names in (("agents", [a.id for a in whole]), ("references", [a.reference for a in whole])):
                run.kill()
                for path in (folder / "kv").glob("*.kv"):  # the files spills left would restore some of them
                    path.unlink()
                run = checked_start(runs)
                for name in names:
                    text, fields = decode(run, name, 12)
                    assert fields["kv_restored_from"] == "tokens", fields
                    continuations[side].append(text)
            for agent, text, reference in zip(whole, continuations["agents"], continuations["references"], strict=True):
                assert text == reference, f"{agent.id}: its continuation differs from its reference's"
            assert run.terminate() == 0, run.output()[-3000:]
            hung = False
            assert not strays(folder), strays(folder)
        finally:
            runs.close()
            record_case(crashed=crashed, hung=hung, lost_data=lost)
    summary = {a.id: (len(a.turns), a.unacked_applied, a.lost_inflight, compared[a.id]) for a in line_agents}
    print(f"kills with a request in flight: {kills_mid_turn}/{kills}; line agents (turns, committed but not "
          f"acknowledged, lost in flight, turns compared with the replay): {summary}; OpenAI agents' restarts with a "
          f"turn in flight: { {a.id: len(a.checks) for a in http_agents} }")
    assert kills_mid_turn >= KILLS // 2, f"only {kills_mid_turn} of {kills} kills cut a request in flight"
    assert any(compared[a.id] == len(a.turns) for a in line_agents), (
        f"every replay took another token at a near-tie: no conversation was compared whole: {summary}")


# -- 2. SIGTERM, then restart: every durable agent's KV state comes back from disk ----------------------------------


def chat_turns(app: Any, user: str, model: str, contents: list[str]) -> list[tuple[list[dict[str, str]], str]]:
    """An OpenAI ``user`` agent's turns, one after another, the whole history each time; each turn's messages and
    reply."""
    history: list[dict[str, str]] = []
    turns = []
    for content in contents:
        messages = [*history, {"role": "user", "content": content}]
        got = app.chat({"model": model, "user": user, "messages": messages, "max_tokens": 8, "temperature": 0})
        reply = got["choices"][0]["message"]["content"]
        turns.append((messages, reply))
        history = [*messages, {"role": "assistant", "content": reply}]
    return turns


def test_sigterm_then_restart_restores_every_agent_from_disk(record_case, tiny_model: Path, tiny_model_b: Path):
    """Line agents on both models and OpenAI ``user`` agents on both decode a few turns (one at a time, so that a
    replay computes its states alike), SIGTERM (exit 0, a KV file per agent), restart: each agent's next decode
    says ``kv_restored_from=disk`` (line header, OpenAI usage with cached tokens, STATUS, health and metrics count
    them), and continues exactly as a fresh reference agent that replays its turns after the restart."""
    line = {"sa": "a", "sb": "b"}
    users = {"oa": "a", "ob": "b"}
    prompts = ["the water of time", "a long day", "how many write"]
    crashed = hung = lost = True
    with state_folder() as (folder, logs):
        config = write_config(folder, {"a": {"path": str(tiny_model), "n_ctx": 1024},
                                       "b": {"path": str(tiny_model_b), "n_ctx": 1024}},
                              engine={"live_slots": 1})
        runs = Runs(config, logs)
        try:
            run = checked_start(runs)
            texts: dict[str, list[str]] = {}
            for agent, model in line.items():
                assert run.line(f"REGISTER {agent} {model}").startswith("OK ")
                texts[agent] = [decode(run, agent, 8, prompt)[0] for prompt in prompts]
            chats = {user: chat_turns(run, user, model, prompts) for user, model in users.items()}
            assert run.terminate() == 0, run.output()[-3000:]
            held = sorted(path.name for path in (folder / "kv").iterdir())
            ids = {*line, *(user_agent_id(user, model) for user, model in users.items())}
            assert not ids - {name.removesuffix(".kv") for name in held}, (ids, held)
            run = checked_start(runs)
            crashed = False
            for agent, model in line.items():
                text, fields = decode(run, agent, 12)
                assert fields["kv_restored_from"] == "disk" and fields["kv_swap_restored"] == "true", fields
                reference = f"ref-{agent}"
                assert run.line(f"REGISTER {reference} {model}").startswith("OK ")
                assert [decode(run, reference, 8, prompt)[0] for prompt in prompts] == texts[agent]
                assert decode(run, reference, 12)[0] == text, f"{agent}: its continuation differs from a replay's"
            for user, model in users.items():
                last = [*chats[user][-1][0], {"role": "assistant", "content": chats[user][-1][1]},
                        {"role": "user", "content": "and after the restart"}]
                body = {"model": model, "messages": last, "max_tokens": 8, "temperature": 0}
                got = run.chat({**body, "user": user})
                assert got["usage"]["kv_restored_from"] == "disk", got["usage"]
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, got["usage"]
                reference = f"ref-{user}"
                again = chat_turns(run, reference, model, prompts)
                assert [reply for _, reply in again] == [reply for _, reply in chats[user]], user
                want = run.chat({**body, "user": reference})
                assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], user
            lost = False
            status = run.agents()
            for ident in ids:
                assert status[ident]["kv_restored_from"] == "disk", status[ident]
            assert run.health()["kv_restored_from"]["disk"] == len(ids), run.health()["kv_restored_from"]
            metrics = httpx.get(run.url + "/metrics", timeout=HUNG_S).text
            assert f'appliance_kv_restored_from_total{{tier="disk"}} {len(ids)}.0' in metrics, \
                [line for line in metrics.splitlines() if "restored_from" in line]
            assert run.terminate() == 0, run.output()[-3000:]
            hung = False
        finally:
            runs.close()
            record_case(crashed=crashed, hung=hung, lost_data=lost)


# -- 3. host KV budget overflow: spilled to disk and back -----------------------------------------------------------

SPILL_PROMPTS = {"h1": "the water of time", "r1": "the water of time", "h2": "a long day", "h3": "people call first",
                 "h4": "go come", "h5": "down side"}
"""``r1`` is ``h1``'s reference: the same turn, parked and spilled the same way after it."""
HOST_KV_BUDGET = 200_000  # two or three of these parked states (~40-55 KB each), not four


@pytest.mark.parametrize("disk_kv_budget", [100_000_000, 0], ids=["disk-tier", "no-disk-tier"])
def test_host_kv_overflow_spills_to_disk_and_back(record_case, tiny_model: Path, disk_kv_budget: int):
    """``engine.live_slots: 1`` and a host KV budget of two or three parked states: six agents decode one after the
    other, so that parking the later ones spills the first (``h1``) to ``kv/h1.kv``, and its return spills its
    reference ``r1`` (which decoded the same turn after it). Their next decodes say ``kv_restored_from=disk`` and
    continue alike. With ``disk_kv_budget: 0`` (the behaviour before the disk tier) the same sequence drops their
    state instead: no file, ``kv_restored_from=tokens``, the same continuation."""
    crashed = True
    lost = True
    try:
        with running({"a": {"path": str(tiny_model), "n_ctx": 256}}, model_dirs=[tiny_model.parent],
                     engine={"live_slots": 1}, host_kv_budget=HOST_KV_BUDGET, disk_kv_budget=disk_kv_budget) as app:
            kv = app.appliance.config.data_dir / "kv"
            first: dict[str, str] = {}
            for agent, prompt in SPILL_PROMPTS.items():
                assert app.line(f"REGISTER {agent} a").startswith("OK ")
                first[agent] = decode(app, agent, 8, prompt)[0]
            assert first["h1"] == first["r1"]
            assert (kv / "h1.kv").exists() == bool(disk_kv_budget), list(kv.glob("*")) if kv.exists() else None
            tier = "disk" if disk_kv_budget else "tokens"
            text, fields = decode(app, "h1", 12)
            assert fields["kv_restored_from"] == tier, fields
            assert (kv / "r1.kv").exists() == bool(disk_kv_budget), list(kv.glob("*")) if kv.exists() else None
            reference, fields = decode(app, "r1", 12)
            assert fields["kv_restored_from"] == tier, fields
            crashed = False
            assert text == reference, "a spilled agent's continuation differs from its reference's"
            lost = False
            doc = httpx.get(app.appliance.http_url + "/v1/health", timeout=HUNG_S).json()
            if disk_kv_budget:
                assert doc["host_kv"]["spills"] >= 2 and doc["disk_kv"]["reads"] >= 2, doc
                assert doc["disk_kv"]["discarded"] == 0 and doc["disk_kv"]["status"] == "ok", doc["disk_kv"]
            else:
                assert "disk_kv" not in doc and doc["host_kv"]["drops"] >= 2, doc
    finally:
        record_case(crashed=crashed, lost_data=lost)


def test_a_state_read_back_from_disk_is_not_dropped_again_for_a_swap(record_case, tiny_model: Path):
    """A host KV budget of about two parked states and a disk tier; four agents decode in turn (``engine.live_slots:
    1``), so the earlier ones are spilled to disk, then come back one after the other. An agent whose KV file is on
    disk when its decode starts has its state read back (into host RAM) while the live one is parked: that state
    should come back (``kv_restored_from=disk``), the parked ones going to disk, not be dropped for the swap and its
    tokens re-evaluated after a wasted read (its file kept)."""
    crashed = True
    try:
        with running({"a": {"path": str(tiny_model), "n_ctx": 256}}, model_dirs=[tiny_model.parent],
                     engine={"live_slots": 1}, host_kv_budget=100_000, disk_kv_budget=100_000_000) as app:
            kv = app.appliance.config.data_dir / "kv"
            for agent, prompt in (("h1", "the water of time"), ("h2", "a long day"), ("h3", "people call first"),
                                  ("h4", "the water of time")):
                assert app.line(f"REGISTER {agent} a").startswith("OK ")
                decode(app, agent, 8, prompt)
            came_back = []
            for agent, n_tokens in (("h2", 4), ("h3", 4), ("h1", 12)):
                on_disk = (kv / f"{agent}.kv").exists()
                _, fields = decode(app, agent, n_tokens)
                came_back.append((agent, on_disk, fields["kv_restored_from"]))
            doc = httpx.get(app.appliance.http_url + "/v1/health", timeout=HUNG_S).json()
            crashed = False
            wasted = [(agent, tier) for agent, on_disk, tier in came_back if on_disk and tier != "disk"]
            assert not wasted, (f"agents whose KV file was on disk came back from {wasted}: {doc['disk_kv']['reads']} "
                                f"disk reads, {doc['host_kv']['drops']} host drops ({came_back})")
    finally:
        record_case(crashed=crashed)


# -- 4. corrupt and mismatched KV files fall back to tokens --------------------------------------------------------


def read_kv(path: Path) -> tuple[kvfiles.Header, bytes]:
    with open(path, "rb") as fh:
        header = kvfiles.read_header(fh)
        return header, fh.read()


def flip_a_state_byte(path: Path) -> None:
    header, state = read_kv(path)
    data = bytearray(path.read_bytes())
    data[len(data) - len(state) + len(state) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    header, state = read_kv(path)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size - len(state) // 2)


def rewrite_header(path: Path, **changes: Any) -> None:
    header, state = read_kv(path)
    path.write_bytes(kvfiles.encode_header(dataclasses.replace(header, **changes)) + state)


def garbage(path: Path) -> None:
    path.write_bytes(random.Random(7).randbytes(path.stat().st_size))


CRAFTED = {
    "k-flip": flip_a_state_byte,  # the checksum fails
    "k-trunc": truncate,  # shorter than its header says
    "k-nctx": lambda path: rewrite_header(path, n_ctx=read_kv(path)[0].n_ctx * 2),  # made for another context
    "k-model": lambda path: rewrite_header(path, model_file="1:2:3:4"),  # made for another model file
    "k-digest": lambda path: rewrite_header(path, tokens_digest="0" * 32),  # holds other tokens
    "k-garbage": garbage,  # not a KV file at all
}


def test_corrupt_and_mismatched_kv_files_fall_back_to_tokens(record_case, tiny_model: Path):
    """Seven agents decode the same turn; SIGTERM writes their KV files; six are crafted before the restart (a
    flipped state byte, a truncated file, a header for another ``n_ctx``, for another model file, for other tokens,
    garbage) and the reference's is deleted. After the restart each crafted agent's next decode says
    ``kv_restored_from=tokens`` and continues as the reference (re-evaluated too); the daemon logs one warning per
    discarded file, deletes it, counts it, and serves on."""
    crashed = hung = lost = True
    agents = [*CRAFTED, "k-ref"]
    with state_folder() as (folder, logs):
        config = write_config(folder, {"a": {"path": str(tiny_model), "n_ctx": 512}}, engine={"live_slots": 2})
        runs = Runs(config, logs)
        try:
            run = checked_start(runs)
            for agent in agents:
                assert run.line(f"REGISTER {agent} a").startswith("OK ")
                decode(run, agent, 8, "the water of time")
            assert run.terminate() == 0, run.output()[-3000:]
            stored = stored_tokens(folder)
            assert len({stored[agent] for agent in agents}) == 1, "the same turn left other tokens"
            kv = folder / "kv"
            for agent, craft in CRAFTED.items():
                craft(kv / f"{agent}.kv")
            (kv / "k-ref.kv").unlink()
            run = checked_start(runs)
            reference, fields = decode(run, "k-ref", 12)
            assert fields["kv_restored_from"] == "tokens", fields
            crashed = False
            for agent in CRAFTED:
                text, fields = decode(run, agent, 12)
                assert fields["kv_restored_from"] == "tokens", (agent, fields)
                assert text == reference, f"{agent}: its continuation after a bad KV file differs from the reference's"
                assert not (kv / f"{agent}.kv").exists(), f"{agent}'s bad KV file was not deleted"
            lost = False
            output = run.output()
            for agent in agents:
                warnings = re.findall(rf"WARNING .*disk KV: agent {agent}'s file .* is discarded", output)
                assert len(warnings) == (agent != "k-ref"), (agent, warnings)
            doc = run.health()
            assert doc["status"] == "ok" and doc["disk_kv"]["discarded"] == len(CRAFTED), doc["disk_kv"]
            assert run.terminate() == 0, run.output()[-3000:]
            hung = False
        finally:
            runs.close()
            record_case(crashed=crashed, hung=hung, lost_data=lost)


# -- 5. a corrupt store is moved aside ---------------------------------------------------------------------------------


def overwrite_with_garbage(path: Path) -> None:
    path.write_bytes(random.Random(5).randbytes(path.stat().st_size))


def damage_a_page(path: Path) -> None:
    """Seeded random bytes over the second page (SQLite's default page is 4 KiB; the first holds the schema)."""
    with open(path, "r+b") as fh:
        fh.seek(4096)
        fh.write(random.Random(6).randbytes(4096))


@pytest.mark.parametrize("damage", [overwrite_with_garbage, damage_a_page], ids=["garbage", "damaged-page"])
def test_a_corrupt_store_is_moved_aside_and_a_new_one_begun(record_case, tiny_model: Path, damage: Any):
    """Agents decode, SIGTERM, the store is damaged before the next start: the appliance starts anyway, with
    ``agents.db.corrupt-<time>`` beside a new store, a health notice naming it and an ERROR log line; the old agents
    are not restored (their KV files are deleted), new agents register and decode, and the new store keeps them
    across the next restart (no notice then)."""
    crashed = hung = True
    with state_folder() as (folder, logs):
        config = write_config(folder, {"a": {"path": str(tiny_model), "n_ctx": 512}})
        runs = Runs(config, logs)
        try:
            run = checked_start(runs)
            for agent in ("x1", "x2", "x3"):
                assert run.line(f"REGISTER {agent} a").startswith("OK ")
                decode(run, agent, 6, "a long day")
            assert run.terminate() == 0, run.output()[-3000:]
            assert not (folder / "agents.db-wal").exists() or (folder / "agents.db-wal").stat().st_size == 0
            damage(folder / "agents.db")
            run = runs.start()
            crashed = False
            [aside] = corrupt_files(folder)
            doc = run.health()
            assert [notice for notice in doc["notices"] if aside in notice], doc["notices"]
            assert doc["store"]["status"] == "ok" and doc["store"]["moved_aside"].endswith(aside), doc["store"]
            assert re.search(rf"ERROR .*the agents store .* moved aside to .*{re.escape(aside)}", run.output())
            assert run.agents() == {}, "agents of a corrupt store were restored"
            assert not list((folder / "kv").glob("*.kv")), "the old agents' KV files were kept"
            for agent in ("x1", "n1"):
                assert run.line(f"REGISTER {agent} a").startswith("OK ")
                decode(run, agent, 6, "go come")
            tokens = {ident: record["tokens"] for ident, record in run.agents().items()}
            assert run.terminate() == 0, run.output()[-3000:]
            run = runs.start()
            doc = run.health()
            assert doc["status"] == "ok" and not doc["notices"], doc
            assert {ident: record["tokens"] for ident, record in run.agents().items()} == tokens
            assert corrupt_files(folder) == [aside]
            assert run.terminate() == 0, run.output()[-3000:]
            hung = False
        finally:
            runs.close()
            record_case(crashed=crashed, hung=hung)


# -- 6. a full disk while running -------------------------------------------------------------------------------------

MOUNT = Path(f"/tmp/hd-full-{os.getpid()}")
TMPFS_SIZE = "1m"
FILLER = "filler.bin"
RECOVERY_S = statefiles.MAX_RETRY_S + 20.0  # the store's longest retry wait (and the disk tier's probe), plus slack


@contextmanager
def tmpfs() -> Iterator[Path]:
    """A :data:`TMPFS_SIZE` tmpfs at :data:`MOUNT` (skips where mounting is not permitted), unmounted after."""
    MOUNT.mkdir(exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(MOUNT)], check=True,
                       capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        MOUNT.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({getattr(exc, 'stderr', None) or exc}): a full disk needs a real "
                    "one (tests/test_durable.py has the store's write failures injected)")
    try:
        yield MOUNT
    finally:
        unmounted = subprocess.run(["umount", str(MOUNT)], capture_output=True, text=True, timeout=30)
        if unmounted.returncode != 0:
            subprocess.run(["umount", "--lazy", str(MOUNT)], capture_output=True, timeout=30)
        shutil.rmtree(MOUNT, ignore_errors=True)


def fill(folder: Path) -> None:
    chunk = b"\0" * 4096
    with open(folder / FILLER, "wb", buffering=0) as filler, pytest.raises(OSError) as raised:
        while True:
            filler.write(chunk)
    assert raised.value.errno == errno.ENOSPC, raised.value


def test_a_full_disk_keeps_serving_and_loses_no_acknowledged_agent(record_case, tiny_model_b: Path):
    """``appliance run`` with its state folder on a 1 MiB tmpfs, a host KV budget of about one parked state (so that
    parking spills to disk). Filled to the last byte, it serves every REGISTER and DECODE; ``/v1/health`` says
    ``degraded``: the agents store (ENOSPC, its writes kept in memory and retried) and the disk tier (a spill that
    failed). Once the space is freed it is ``ok`` again within the store's longest retry wait; after a SIGTERM and
    a restart every agent is there with the tokens it had: the ones registered while the disk was full too."""
    crashed = hung = lost = True
    with tmpfs() as folder, state_folder() as (_, logs):
        config = write_config(folder, {"b": {"path": str(tiny_model_b), "n_ctx": 256}}, engine={"live_slots": 1},
                              host_kv_budget=20_000, disk_kv_budget=300_000)
        runs = Runs(config, logs)
        try:
            run = checked_start(runs)
            for agent in ("f1", "f2", "f3"):
                assert run.line(f"REGISTER {agent} b").startswith("OK ")
                decode(run, agent, 8, "the water of time")
            assert list((folder / "kv").glob("*.kv")), "nothing was spilled before the disk was full"
            assert run.health()["status"] == "ok"
            fill(folder)
            for agent in ("f4", "f5"):
                assert run.line(f"REGISTER {agent} b").startswith("OK ")
                decode(run, agent, 8, "a long day")
            for agent in ("f1", "f2", "f3", "f4"):
                decode(run, agent, 8, "people call first")
            crashed = False
            doc = run.health()
            assert doc["status"] == "degraded" and "agents store" in doc["reason"], doc
            assert doc["store"]["status"] == "degraded" and doc["store"]["errno"] == "ENOSPC", doc["store"]
            assert doc["disk_kv"]["status"] == "degraded" and doc["disk_kv"]["errno"] == "ENOSPC", doc["disk_kv"]
            tokens = {ident: record["tokens"] for ident, record in run.agents().items()}
            assert set(tokens) == {"f1", "f2", "f3", "f4", "f5"}, tokens
            (folder / FILLER).unlink()
            deadline = time.monotonic() + RECOVERY_S
            while doc["status"] != "ok" and time.monotonic() < deadline:
                time.sleep(0.2)
                doc = run.health()
            assert doc["status"] == "ok", f"still {doc['status']} {RECOVERY_S:g} s after the disk had room: {doc}"
            assert doc["store"]["status"] == "ok" and doc["store"]["pending"] == 0, doc["store"]
            assert run.terminate() == 0, run.output()[-3000:]
            hung = False
            run = checked_start(runs)
            after = {ident: record["tokens"] for ident, record in run.agents().items()}
            assert after == tokens, f"after the restart the agents' tokens are {after}, before it {tokens}"
            assert run.line("REGISTER f5 b").startswith("ERR AGENT_EXISTS")
            decode(run, "f5", 4)
            lost = False
            assert run.terminate() == 0, run.output()[-3000:]
        finally:
            runs.close()
            record_case(crashed=crashed, hung=hung, lost_data=lost)

"""A real fleet on one machine: three ``appliance run`` processes behind a real LiteLLM router (docs/fleet.md).

Two boxes serve the model ``alpha``, one serves ``beta``; each is its own process with its own config file, data
dir, socket and loopback port, and names itself with ``http.instance_name``, which it sends back on every
generation reply as ``x-appliance-instance``. LiteLLM surfaces a provider's response headers as
``llm_provider-<header>`` in the reply's ``_hidden_params["additional_headers"]``, so every count below is what
the boxes themselves said, not what the router believes it chose.

The router is ``litellm.Router`` in-process, not the LiteLLM proxy: the proxy is the same Router behind a web
server, and its ``litellm[proxy]`` extra brings about forty more packages (a separate ``litellm-proxy``, FastAPI,
gunicorn and granian, Azure and AWS clients, polars, ...) that would share the test environment with the appliance's
own Starlette (its virtual keys and spend logs also want a database, which routing does not); the Router is the part
that routes, retries and keeps affinity, needs nothing beyond ``litellm`` and runs in the test's own event loop. The
proxy's YAML in docs/fleet.md sets the same options (not run here).

Affinity is LiteLLM's ``session_affinity`` pre-call check: the first request of a session id is placed by the
routing strategy (``least-busy``), and the session's later requests go to the deployment it was pinned to. It keys
on ``metadata.session_id`` (the proxy takes it from an ``x-litellm-session-id`` header), not on the OpenAI ``user``
field, which LiteLLM deliberately ignores for affinity; so each agent sends its name as both: ``user`` (the
appliance's agent ``<user>@<model>``) and the session id (the router's pin). LiteLLM passes ``user`` on to an
``openai/...`` deployment only when its ``allowed_openai_params`` say so (else it drops it without a word, and the
box runs each turn stateless): every reply's ``x-appliance-agent`` header shows that the box ran it in the agent.

The run: 12 agents (8 on alpha, 4 on beta) each take 5 turns, one after the other, all agents at once: 60 chat
requests. Once 30 have been answered, one alpha box is killed with SIGKILL. LiteLLM retries a failed request on
another deployment of its group and cools the dead one down, and ``session_affinity_repin_on_failover`` moves its
agents' pins to the survivor. Checked: each model's requests are answered only by its boxes; both alpha boxes get
agents; every agent's turns before the kill are on one box, and after it on one box; every request that started
after the kill is answered; every request has an outcome the client saw (a reply or an exception: none hangs).
The table (and benchmarks/results/fleet.json) adds the latency of the same request through the router and straight
to a box, taken one after the other on an otherwise idle fleet (a figure, not a bound: this test checks no speed).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import yaml

if TYPE_CHECKING:
    import litellm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "fleet.json"
UP_S = 90.0  # a slow, loaded 2-core box: interpreter, model file, bind
REQUEST_TIMEOUT_S = 30.0
RUN_BOUND_S = 120.0
INSTANCE_HEADER = "llm_provider-x-appliance-instance"
AGENT_HEADER = "llm_provider-x-appliance-agent"
BOXES = {"box-a1": ("alpha", 11), "box-a2": ("alpha", 12), "box-b": ("beta", 13)}
"""Each box: the one model it serves and the seed of that model's tiny weights (the same seed for one model's
boxes: one model, two boxes)."""
AGENTS = {**{f"agent-a{i}": "alpha" for i in range(8)}, **{f"agent-b{i}": "beta" for i in range(4)}}
TURNS = 5
KILL_AFTER = 30
LATENCY_SAMPLES = 10

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pydantic")  # litellm's own typing notes on import


@dataclass
class Box:
    name: str
    model: str
    folder: Path
    process: subprocess.Popen[bytes]
    url: str = ""


@dataclass
class Turn:
    agent: str
    model: str
    turn: int
    started: float
    finished: float = 0.0
    box: str | None = None
    deployment: str | None = None
    keyed: str | None = None
    retries: int = 0
    error: str | None = None


@dataclass
class Run:
    turns: list[Turn] = field(default_factory=list)
    killed_at: float | None = None
    answered: int = 0


def box_config(folder: Path, name: str, model: str, seed: int) -> Path:
    doc = {"data_dir": str(folder), "device": "fake:8GiB", "resync_interval_s": 0, "shutdown_grace_s": 1,
           "socket": {"path": str(folder / "a.sock")},
           "http": {"host": "127.0.0.1", "port": 0, "instance_name": name},
           "engine": {"warmup_runs": 0},
           "models": [{"name": model, "path": str(folder / "models" / f"{model}.gguf"),
                       "generate_if_missing": {"layers": 2, "dim": 64, "seed": seed}}]}
    path = folder / "appliance.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def wait_up(box: Box, deadline: float) -> None:
    registry = box.folder / "registry.json"
    while not registry.exists():
        if box.process.poll() is not None:
            log = (box.folder / "log").read_text(errors="replace").splitlines()[-15:]
            pytest.fail(f"{box.name} exited with {box.process.returncode}:\n" + "\n".join(log))
        assert time.monotonic() < deadline, f"{box.name} did not come up in {UP_S:.0f} s"
        time.sleep(0.1)
    box.url = json.loads(registry.read_text())["http"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Box]]:
    boxes: dict[str, Box] = {}
    try:
        for name, (model, seed) in BOXES.items():
            folder = Path(tempfile.mkdtemp(prefix=f"fl-{name}-"))
            config = box_config(folder, name, model, seed)
            process = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)],
                                       cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(folder / "log").open("wb"))
            boxes[name] = Box(name, model, folder, process)
        deadline = time.monotonic() + UP_S
        for box in boxes.values():
            wait_up(box, deadline)
        yield boxes
    finally:
        for box in boxes.values():
            if box.process.poll() is None:
                box.process.send_signal(signal.SIGTERM)
        for box in boxes.values():
            box.process.wait(30)
            shutil.rmtree(box.folder, ignore_errors=True)


def router_for(boxes: dict[str, Box], *, affinity: bool = True) -> litellm.Router:
    """Every box as a deployment of its model's group (``openai/<model>`` at the box's ``/v1``; the deployment id
    is the box's name), allowed to pass OpenAI's ``user`` on (LiteLLM drops it, silently, for a model that is not
    in OpenAI's own catalogue); retries across the group and a cool-down for a box that fails. With ``affinity``:
    least-busy placement (the deployment with the fewest requests in flight; a tie goes to the first) and session
    affinity; without: LiteLLM's default, simple-shuffle (a random deployment per request), and no affinity."""
    deployments = [{"model_name": box.model,
                    "litellm_params": {"model": f"openai/{box.model}", "api_base": f"{box.url}/v1",
                                       "api_key": "none", "allowed_openai_params": ["user"]},
                    "model_info": {"id": box.name}}
                   for box in boxes.values()]
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price list from the wheel, never fetched
    import litellm  # here, not at the top: its import takes seconds, which a run that skips this test need not pay

    return litellm.Router(model_list=deployments, routing_strategy="least-busy" if affinity else "simple-shuffle",
                          optional_pre_call_checks=["session_affinity"] if affinity else [],
                          session_affinity_repin_on_failover=affinity,
                          num_retries=3, retry_after=0, allowed_fails=0, cooldown_time=60,
                          timeout=REQUEST_TIMEOUT_S)


def answering_box(reply: Any) -> str:
    """The box that answered, from its own ``x-appliance-instance`` header as LiteLLM passes it back."""
    headers = reply._hidden_params.get("additional_headers") or {}
    name = headers.get(INSTANCE_HEADER)
    assert isinstance(name, str), f"no {INSTANCE_HEADER} in the reply's headers: {sorted(headers)}"
    return name


async def agent_turns(router: litellm.Router, agent: str, model: str, run: Run, boxes: dict[str, Box],
                      turns: int = TURNS, pinned: bool = True) -> None:
    """One agent's conversation: each turn re-sends the history (as OpenAI clients do) with the agent as ``user``
    and (``pinned``) as the router's session id; once ``KILL_AFTER`` requests of ``run`` are answered, box-a1 is
    killed."""
    session = {"metadata": {"session_id": agent}} if pinned else {}
    history = [{"role": "user", "content": f"This is {agent}. Tell me a short story about a lighthouse."}]
    for number in range(turns):
        turn = Turn(agent, model, number, time.monotonic())
        run.turns.append(turn)
        try:
            reply = await router.acompletion(model=model, messages=history, max_tokens=6, temperature=0,
                                             user=agent, **session)
            turn.box = answering_box(reply)
            turn.deployment = reply._hidden_params.get("model_id")
            headers = reply._hidden_params.get("additional_headers") or {}
            turn.keyed = headers.get(AGENT_HEADER)
            turn.retries = int(headers.get("x-litellm-attempted-retries") or 0)
            history += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                        {"role": "user", "content": "And then?"}]
        except Exception as error:  # every failure is an outcome the client saw: counted, never hidden
            turn.error = f"{type(error).__name__}: {error}"[:300]
        turn.finished = time.monotonic()
        run.answered += 1
        if run.answered == KILL_AFTER and run.killed_at is None and turns == TURNS:
            boxes["box-a1"].process.send_signal(signal.SIGKILL)
            run.killed_at = time.monotonic()


async def fleet_run(router: litellm.Router, boxes: dict[str, Box]) -> Run:
    """Every agent's conversation at once, for at most ``RUN_BOUND_S``: a turn still without an outcome then is
    left unfinished (``finished`` 0), which the test counts as lost."""
    run = Run()
    tasks = [asyncio.create_task(agent_turns(router, agent, model, run, boxes)) for agent, model in AGENTS.items()]
    _, pending = await asyncio.wait(tasks, timeout=RUN_BOUND_S)
    for task in pending:
        task.cancel()
    return run


async def latencies(router: litellm.Router, box: Box) -> dict[str, list[float]]:
    """The same stateless request to ``beta``, alternately through the router and straight to its box."""
    body = {"model": box.model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0}
    figures: dict[str, list[float]] = {"router": [], "direct": []}
    async with httpx.AsyncClient(base_url=box.url, timeout=REQUEST_TIMEOUT_S) as client:
        for _ in range(LATENCY_SAMPLES):
            start = time.perf_counter()
            direct = await client.post("/v1/chat/completions", json=body)
            figures["direct"].append(time.perf_counter() - start)
            assert direct.status_code == 200, direct.text
            start = time.perf_counter()
            await router.acompletion(**body)
            figures["router"].append(time.perf_counter() - start)
    return figures


async def unpinned(boxes: dict[str, Box]) -> float:
    """Affinity held by 4 alpha agents taking 3 turns each, with no session id, through a router that shuffles:
    what the option is there for (a figure for the table: a random draw may happen to keep them)."""
    run = Run()
    router = router_for(boxes, affinity=False)
    await asyncio.wait_for(asyncio.gather(*(agent_turns(router, f"free-{i}", "alpha", run, boxes, 3, False)
                                            for i in range(4))), RUN_BOUND_S)
    assert all(turn.box is not None for turn in run.turns), [turn.error for turn in run.turns]
    return affinity_held(run.turns)


async def measured(router: litellm.Router, boxes: dict[str, Box]) -> tuple[dict[str, list[float]], float, Run]:
    """The latencies on an idle fleet, affinity without the option, then the fleet run, in one event loop (the
    routers' clients are the loop's)."""
    await router.acompletion(model="beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    figures = await latencies(router, boxes["box-b"])
    without = await unpinned(boxes)
    return figures, without, await fleet_run(router, boxes)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def spread(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 0.5), 4), "p99": round(percentile(values, 0.99), 4)}


def affinity_held(turns: list[Turn]) -> float:
    """Turns of each agent on its majority box, over all answered turns (1.0: no agent ever moved)."""
    by_agent: dict[str, Counter[str]] = {}
    for turn in turns:
        if turn.box is not None:
            by_agent.setdefault(turn.agent, Counter())[turn.box] += 1
    total = sum(sum(counts.values()) for counts in by_agent.values())
    held = sum(counts.most_common(1)[0][1] for counts in by_agent.values())
    return held / total if total else 0.0


def table(run: Run, boxes: dict[str, Box], figures: dict[str, list[float]]) -> dict[str, Any]:
    assert run.killed_at is not None
    before = [turn for turn in run.turns if turn.finished <= run.killed_at]
    in_flight = [turn for turn in run.turns if turn.started < run.killed_at and not 0 < turn.finished < run.killed_at]
    after = [turn for turn in run.turns if turn.started >= run.killed_at]
    answered = [turn for turn in run.turns if turn.box is not None]
    run_latency = [turn.finished - turn.started for turn in answered]
    return {
        "boxes": {name: box.model for name, box in boxes.items()},
        "killed": "box-a1",
        "router": f"litellm.Router {importlib.metadata.version('litellm')}, in-process",
        "strategy": "least-busy, session_affinity on session_id = agent, 3 retries, cool-down 60 s",
        "requests": len(run.turns),
        "requests_per_box": dict(sorted(Counter(turn.box for turn in answered).items())),
        "requests_per_box_before_kill": dict(sorted(Counter(turn.box for turn in before if turn.box).items())),
        "affinity_held": round(affinity_held(run.turns), 3),
        "affinity_held_before_kill": round(affinity_held(before), 3),
        "affinity_held_after_kill": round(affinity_held(after), 3),
        "in_flight_at_kill": len(in_flight),
        "in_flight_at_kill_answered": sum(1 for turn in in_flight if turn.box is not None),
        "in_flight_at_kill_errors": sum(1 for turn in in_flight if turn.error is not None),
        "retried_by_the_router": sum(1 for turn in run.turns if turn.retries > 0),
        "started_after_kill": len(after),
        "lost_after_kill": sum(1 for turn in after if turn.box is None),
        "errors": sum(1 for turn in run.turns if turn.error is not None),
        "unaccounted": sum(1 for turn in run.turns if turn.finished == 0.0),
        "run_latency_s": spread(run_latency),
        "sequential_latency_s": {way: spread(values) for way, values in figures.items()},
    }


def log_tails(boxes: dict[str, Box]) -> str:
    tails = []
    for box in boxes.values():
        lines = (box.folder / "log").read_text(errors="replace").splitlines()
        tails.append("\n".join([f"--- {box.name}", *lines[-15:]]))
    return "\n".join(tails)


def printed(result: dict[str, Any]) -> str:
    rows = [f"{'box':<10} {'model':<6} {'requests':>8} {'before kill':>11}"]
    for name, model in result["boxes"].items():
        rows.append(f"{name:<10} {model:<6} {result['requests_per_box'].get(name, 0):>8} "
                    f"{result['requests_per_box_before_kill'].get(name, 0):>11}")
    rows.append(f"affinity held: {result['affinity_held']:.3f} (before the kill "
                f"{result['affinity_held_before_kill']:.3f}, after {result['affinity_held_after_kill']:.3f}; "
                f"without a session id {result['affinity_held_without_session_id']:.3f})")
    rows.append(f"killed {result['killed']}: {result['in_flight_at_kill']} in flight "
                f"({result['in_flight_at_kill_answered']} answered, {result['in_flight_at_kill_errors']} errors; "
                f"{result['retried_by_the_router']} retried by the router), "
                f"{result['started_after_kill']} started after, {result['lost_after_kill']} lost after the kill")
    sequential = result["sequential_latency_s"]
    whole = result["run_latency_s"]
    rows.append(f"latency p50/p99 (s): router {sequential['router']['p50']}/{sequential['router']['p99']}, "
                f"direct {sequential['direct']['p50']}/{sequential['direct']['p99']}; "
                f"the 60-request run through the router {whole['p50']}/{whole['p99']}")
    return "\n".join(rows)


@pytest.mark.slow
def test_a_fleet_behind_litellm_keeps_models_apart_spreads_load_keeps_agents_and_survives_a_kill(
        fleet: dict[str, Box]) -> None:
    router = router_for(fleet)
    for box in fleet.values():  # each box loads its model once before anything is timed
        warm = httpx.post(f"{box.url}/v1/chat/completions", timeout=UP_S,
                          json={"model": box.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert warm.status_code == 200, warm.text
        assert warm.headers.get("x-appliance-instance") == box.name
    figures, without, run = asyncio.run(measured(router, fleet))
    hung = [(turn.agent, turn.turn) for turn in run.turns if turn.finished == 0.0]
    assert not hung, f"no outcome after {RUN_BOUND_S:.0f} s for {hung}; the boxes' logs:\n{log_tails(fleet)}"
    result = table(run, fleet, figures)
    result["affinity_held_without_session_id"] = round(without, 3)
    print("\n" + printed(result))
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    assert len(run.turns) == len(AGENTS) * TURNS
    served = {name: box.model for name, box in fleet.items()}
    for turn in run.turns:
        if turn.box is not None:
            assert served[turn.box] == turn.model, f"{turn.agent}'s {turn.model} request answered by {turn.box}"
            assert turn.deployment == turn.box  # the router's choice is the box that answered
            assert turn.keyed == f"{turn.agent}@{turn.model}"  # the box ran it in the agent's conversation
    before = result["requests_per_box_before_kill"]
    assert before.get("box-a1", 0) > 0 and before.get("box-a2", 0) > 0, before
    assert result["affinity_held_before_kill"] == 1.0
    assert result["affinity_held_after_kill"] == 1.0
    assert result["lost_after_kill"] == 0 and result["started_after_kill"] > 0
    assert all(turn.box != "box-a1" for turn in run.turns if turn.started >= run.killed_at)
    assert result["errors"] == result["in_flight_at_kill_errors"]  # only the requests in flight at the kill may fail

"""Host memory for parked agents: many agents with long conversations stay within ``host_kv_budget``.

Without the budget, each parked conversation kept its KV state in host RAM for good (150 agents with 1,500-token
conversations on the tiny model: 915 MB, while the ledger showed 49 MB). With it, the least recently used parked
state goes to disk (``disk_kv_budget``) and is read back when its agent comes back, or, without a disk tier, is
dropped and re-evaluated from its tokens.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from hostile_checks import HUNG_S, request, rss_bytes

MiB = 1024 * 1024
BUDGET = 4 * MiB
AGENTS = 20
COMING_BACK = 4  # agents decoding again after all have parked: their state was dropped, they are rebuilt
SLACK = 24 * MiB
"""RSS growth allowed beyond the budget: the live context's KV pages, touched as long prompts fill it (ledger bytes
on a CPU box: about 10 MiB for one agent's 1,000 tokens with nothing parked), compute buffers, allocator slack."""
PROMPT = "the quick brown fox jumps over the lazy dog " * 22  # about 500 tokens: ~2 MiB of KV state each


def host_kv(base_url: str) -> dict[str, int]:
    with urllib.request.urlopen(base_url + "/v1/health", timeout=HUNG_S) as response:
        return json.loads(response.read())["host_kv"]


@pytest.mark.hostile_config(host_kv_budget="4MiB", disk_kv_budget=0)
def test_many_long_conversations_stay_within_the_host_kv_budget(hostile):
    last, replies = long_conversations(hostile, BUDGET)
    assert last["drops"] >= AGENTS - 3 and last["rebuilds"] >= COMING_BACK and last["spills"] == 0
    assert all("kv_restored_from=tokens" in reply for reply in replies[-COMING_BACK:])


@pytest.mark.hostile_config(host_kv_budget="6MiB")  # a state coming back from disk and the one parked for it fit
def test_many_long_conversations_stay_within_the_host_kv_budget_and_spill_to_disk(hostile):
    last, replies = long_conversations(hostile, 6 * MiB)
    assert last["spills"] >= AGENTS - 3 and last["drops"] == 0 and last["rebuilds"] == 0
    assert all("kv_restored_from=disk" in reply for reply in replies[-COMING_BACK:])


def long_conversations(hostile, budget: int) -> tuple[dict[str, int], list[str]]:  # type: ignore[no-untyped-def]
    """Every agent decodes a long prompt, then the first few come back; host RAM stays within the budget, RSS grows
    by no more than it and the slack, and the neighbour is served. Returns the last host_kv record and the replies."""
    served = hostile.neighbour.served
    rss_before = rss_bytes()
    seen: list[dict[str, int]] = []
    agents = [f"long-{i}" for i in range(AGENTS)]
    replies: list[str] = []
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(HUNG_S)
        sock.connect(str(hostile.socket))
        reader = sock.makefile("rb")
        for agent in agents:
            assert request(sock, reader, f"REGISTER {agent} demo").startswith("OK")
        for agent, prompt in [(a, PROMPT) for a in agents] + [(a, "and then") for a in agents[:COMING_BACK]]:
            reply = request(sock, reader, f"DECODE {agent} 4 {prompt}")
            assert reply.startswith("OK"), reply[-300:]
            replies.append(reply)
            seen.append(host_kv(hostile.http))
        for agent in agents:
            assert request(sock, reader, f"UNREGISTER {agent}").startswith("OK")
    growth = rss_bytes() - rss_before
    assert all(s["budget_bytes"] == budget for s in seen)
    assert max(s["parked_bytes"] for s in seen) <= budget
    last = seen[-1]
    print(f"RSS growth {growth / MiB:.1f} MiB; {AGENTS * 2} MiB would be parked without the budget")
    assert growth < budget + SLACK < AGENTS * 2 * MiB, f"RSS grew {growth / MiB:.0f} MiB"
    assert hostile.neighbour_served_since(served)
    return last, replies

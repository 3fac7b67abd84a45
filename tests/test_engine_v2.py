"""Engine v2 in the daemon (issue #11, SPEC L8-L10) on the real tiny models: live contexts apart from the weights,
conversations of one model decoded together, shared prefixes, and the ledger under every live-context budget."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from harness import running

from appliance.client import lines as lineclient
from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon, context_key
from appliance.daemon.devices import FakeDevice
from appliance.engine import gguf_meta
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.interface import GREEDY, Conversation, Token
from appliance.engine.runtime import Engine, Runtime

FLASH_OFF = {"flash_attention": False}
"""Every text here is compared byte for byte with a solo run's: flash attention off, where that holds (the
engine's default, ``auto``, rounds a batched sequence differently: tests/test_flash_attention.py)."""


def solo(model: Path, prompt: str, n: int, n_ctx: int = 2048, *more: tuple[str, int]) -> list[str]:
    """What one conversation alone in its own runtime generates for ``prompt`` then each of ``more``."""
    runtime = Runtime(model, n_ctx=n_ctx, n_gpu_layers=0, n_threads=1, flash_attention="off")
    try:
        conv = Conversation()
        texts = [runtime.generate(conv, prompt, n).text]
        for text, count in more:
            texts.append(runtime.generate(conv, text, count).text)
        return texts
    finally:
        runtime.close()


def fields(reply: str) -> dict[str, str]:
    return lineclient.header_fields(reply)


def body(reply: str) -> str:
    return reply.split("BEGIN_RESPONSE\n", 1)[1].rsplit("\nEND_RESPONSE", 1)[0]


def test_one_live_context_parks_the_other_models_agents_as_the_seed_transcript_reads(model_dir: Path) -> None:
    """``live_contexts: 1``, agents smol and qwen on two models: DECODE smol, qwen, smol reports none/false,
    smol/false, qwen/true; smol's third answer continues its first exactly; one context key in the ledger."""
    models = {"smol-model": {"path": str(model_dir / "tiny.gguf")},
              "qwen-model": {"path": str(model_dir / "tiny_b.gguf")}}
    with running(models, model_dirs=[model_dir], engine={"live_contexts": 1, **FLASH_OFF}) as app:
        assert app.line("REGISTER smol smol-model").startswith("OK")
        assert app.line("REGISTER qwen qwen-model").startswith("OK")
        transcript = []
        texts = []
        for agent, prompt in (("smol", "Hello world"), ("qwen", "Something else"), ("smol", "")):
            reply = app.line(f"DECODE {agent} 12 {prompt}".rstrip())
            got = fields(reply)
            transcript.append((got["kv_swap_evicted"], got["kv_swap_restored"]))
            texts.append(body(reply))
            contexts = [key for key in app.daemon.ledger.reservations() if key.endswith("(context)")]
            assert len(contexts) == 1, contexts
        assert transcript == [("none", "false"), ("smol", "false"), ("qwen", "true")]
        assert [texts[0], texts[2]] == solo(model_dir / "tiny.gguf", "Hello world", 12, 2048, ("", 12))
        status = app.line("STATUS")
        assert "live_contexts=1" in status and "context model=smol-model slots=4 slots_used=1" in status
        health = httpx.get(app.appliance.http_url + "/v1/health").json()
        assert [c["model"] for c in health["contexts"]] == ["smol-model"]
        assert [p["id"] for p in health["parked_agents"]] == ["qwen"] and health["parked_agents"][0]["bytes"] > 0
        metrics = httpx.get(app.appliance.http_url + "/metrics").text
        assert "appliance_live_contexts 1.0" in metrics
        assert 'appliance_context_slots_used{model="smol-model"} 1.0' in metrics


CANDIDATES = ["Hello world the story", "once upon a time there was a model", "the water is hot today",
              "What is this question about", "my mother said yes to the animal", "a number of people were here",
              "the long day of the year", "how many words can you write", "she said that the way was long",
              "they had some time for all of it"]
MARGIN = 0.005
"""The least gap between a step's best and second-best logit for a prompt to be used: ten times the most a batch
was measured to move a logit against a solo run (4.8e-4, tests/test_batched.py); a closer tie may flip."""


def clear_prompts(model: Path, n_tokens: int, count: int) -> list[str]:
    """``count`` prompts whose greedy continuation of ``n_tokens`` has no near-tie at any step (run alone)."""
    chosen = []
    with ModelWeights(model) as weights:
        for prompt in CANDIDATES:
            with BatchedContext(weights, n_ctx=512, n_seq_max=1, n_batch=64, n_threads=1,
                                flash_attn="off") as context:
                context.add(0, weights.tokenize(prompt, bos=True), GREEDY, n_tokens)
                margin = float("inf")
                while context.has_work():
                    if context.step():
                        top = np.sort(context.logits(0))[-2:]
                        margin = min(margin, float(top[1] - top[0]))
            if margin >= MARGIN:
                chosen.append(prompt)
            if len(chosen) == count:
                return chosen
    raise AssertionError(f"only {len(chosen)} of the candidate prompts have no near-tie")


def test_four_agents_streaming_at_once_get_their_solo_outputs_and_a_cancel_touches_no_other(
        model_dir: Path) -> None:
    prompts = clear_prompts(model_dir / "tiny.gguf", 24, 4)
    expected = [solo(model_dir / "tiny.gguf", prompt, 24)[0] for prompt in prompts]
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 engine={"live_slots": 4, **FLASH_OFF}) as app:
        daemon = app.daemon
        for index in range(5):
            app.line(f"REGISTER a{index} tiny")
        app.engine.delay_s = 0.01  # each step takes a while: the four requests are surely in flight together

        async def together(cancel_index: int | None) -> list[Any]:
            cancels = [threading.Event() for _ in prompts]
            streams: list[list[Token]] = [[] for _ in prompts]

            def sink(index: int) -> Any:
                def on_token(token: Token) -> None:
                    streams[index].append(token)
                    if index == cancel_index and len(streams[index]) == 3:
                        cancels[index].set()
                return on_token

            tasks = [asyncio.ensure_future(daemon.decode(f"a{i}", 24, prompt, GREEDY, sink(i), cancels[i]))
                     for i, prompt in enumerate(prompts)]
            results = await asyncio.gather(*tasks)
            for index, result in enumerate(results):
                assert "".join(t.text for t in streams[index]) == result.generation.text
            # decoded together: every stream had its first token before any other stream had its last
            kept = [stream for index, stream in enumerate(streams) if index != cancel_index]
            firsts = [stream[0].timestamp for stream in kept]
            lasts = [stream[-1].timestamp for stream in kept]
            assert max(firsts) < min(lasts)
            return results

        results = app.call(together(None))
        assert [r.generation.text for r in results] == expected
        for index in range(4):  # the conversations start over, so the same run can be compared again
            app.line(f"UNREGISTER a{index}")
            app.line(f"REGISTER a{index} tiny")
        results = app.call(together(1))
        assert results[1].generation.stop_reason == "cancelled"
        assert [r.generation.text for i, r in enumerate(results) if i != 1] == \
            [text for i, text in enumerate(expected) if i != 1]


def test_a_shared_system_prompt_is_evaluated_once(model_dir: Path) -> None:
    """A 600-token system prompt: the second agent's first request evaluates only its own suffix, and its answer
    is what it would be without sharing."""
    system = "You are a helpful model. " + " ".join(["the story of a model and its memory"] * 75)
    first = system + "\nQuestion: what is the water?"
    second = system + "\nQuestion: who said yes?"
    with running({"tiny": {"path": str(model_dir / "tiny.gguf"), "n_ctx": 2048}}, model_dirs=[model_dir],
                 engine=FLASH_OFF) as app:
        app.line("REGISTER a tiny")
        app.line("REGISTER b tiny")
        one = fields(app.line(f"DECODE a 8 {first}"))
        assert int(one["prompt_tokens"]) > 600 and int(one["prompt_evaluated"]) == int(one["prompt_tokens"])
        reply = app.line(f"DECODE b 8 {second}")
        head = fields(reply)
        assert int(head["prompt_tokens"]) > 600
        assert int(head["prompt_evaluated"]) <= 12  # its own suffix only
        assert body(reply) == solo(model_dir / "tiny.gguf", second, 8)[0]


@pytest.mark.parametrize("live_contexts", [1, 2, None])
def test_the_ledger_stays_under_the_cap_for_200_clients_on_three_models(
        tmp_path: Path, model_dir: Path, live_contexts: int | None) -> None:
    """200 clients register, decode and leave across three models on a device that holds the three models'
    weights but only two of their contexts: the ledger, sampled all along, never exceeds the cap, every decode is
    served, and it returns to 0."""
    shutil.copy(model_dir / "tiny.gguf", model_dir / "third.gguf")
    paths = {"one": model_dir / "tiny.gguf", "two": model_dir / "tiny_b.gguf", "three": model_dir / "third.gguf"}
    n_ctx = 512
    tables = {name: gguf_meta.estimate(gguf_meta.read_model_shape(path), n_ctx) for name, path in paths.items()}
    weights = sum(t.total - t.kv - t.compute for t in tables.values())
    contexts = sorted(t.kv + t.compute for t in tables.values())
    size = weights + contexts[-1] + contexts[-2] + 1024  # two contexts fit, three do not
    doc = {"data_dir": str(tmp_path / "state"), "device": f"fake:{size}", "model_dirs": [str(model_dir)],
           "resync_interval_s": 0, "admission_percent": 100,
           "engine": {"live_contexts": "auto" if live_contexts is None else live_contexts, "live_slots": 2},
           "models": [{"name": name, "path": str(path), "n_ctx": n_ctx} for name, path in paths.items()]}
    config = parse_config(yaml.safe_dump(doc), base_dir=tmp_path)
    daemon = Daemon(config, FakeDevice(size, process_used=0), Engine(1))
    samples: list[tuple[int, int]] = []
    live_counts: list[int] = []

    async def sample(stop: asyncio.Event) -> None:
        while not stop.is_set():
            samples.append((daemon.ledger.allocated, daemon.ledger.cap))
            live_counts.append(len(daemon.live_contexts()))
            await asyncio.sleep(0)

    async def client(index: int) -> str:
        name = f"c{index}"
        model = ("one", "two", "three")[index % 3]
        await asyncio.sleep(random.random() * 0.5)
        await daemon.register(name, model)
        result = await daemon.decode(name, 2, f"client {index} says hello")
        await daemon.unregister(name)
        return result.generation.text

    async def main() -> None:
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(sample(stop))
        try:
            texts = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(200))), 240)
            assert len(texts) == 200 and all(texts)
        finally:
            stop.set()
            await sampler
            allocated = daemon.ledger.allocated
            await daemon.close()
        assert allocated == 0

    random.seed(7)
    started = time.monotonic()
    asyncio.run(main())
    assert len(samples) > 200
    assert all(allocated <= cap for allocated, cap in samples)
    assert max(live_counts) <= (2 if live_contexts is None else live_contexts)
    assert time.monotonic() - started < 240
    assert context_key("one") == "one (context)"

"""JSON codecs on the appliance's hot-path payloads: the standard library's ``json`` vs ``orjson`` vs ``msgspec``.

What the appliance encodes or decodes per request and per streamed token, built with its own code
(``appliance.protocol.messages``, ``appliance.http.openai_schema``):

* ``token_frame``: a 1-token reply over MAGN: the STREAM_TOKEN and TASK_COMPLETE payloads, encoded (the server)
  and decoded (the client);
* ``sse_chunk``: one OpenAI ``chat.completion.chunk`` server-sent event's JSON (encoded per streamed token);
* ``chat_body``: a 2 KB ``/v1/chat/completions`` request body (system + user message, non-ASCII text), decoded
  per request (and its INFER_REQUEST frame payload, encoded by a MAGN client);
* ``chat_reply``: the non-streaming chat completion document, encoded per request.

Each codec is called the way the appliance calls it: stdlib ``json.dumps(value, ensure_ascii=False,
separators=(",", ":")).encode()`` / ``json.loads(text)``, ``orjson.dumps`` / ``orjson.loads``, msgspec's
``Encoder().encode`` / ``Decoder().decode``. Every codec's output must decode to the stdlib's value (exit 1
otherwise). Rounds interleave the codecs in a fresh random order; per operation the median over rounds of the
mean time of one call. The appliance's choice (``appliance/protocol/jsoncodec.py``) is named in the JSON.

Run ``python -m benchmarks.codec`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import orjson

from appliance.http import openai_schema
from appliance.protocol import jsoncodec
from appliance.protocol.messages import ChatMessage, InferRequest, StreamToken, TaskComplete, Usage
from benchmarks.common import BoxLoad, add_output_args, fill_defaults, finish, machine

NAME = "codec"
NOISY_SHARE = 0.10
"""Above this share of the box's CPU used by other processes the HEADLINE says the run was NOISY."""
CODECS = ("stdlib", "orjson", "msgspec")
CHOSEN = jsoncodec.LIBRARY
_MSGSPEC_ENCODER = msgspec.json.Encoder()
_MSGSPEC_DECODER = msgspec.json.Decoder()


def stdlib_dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


DUMPS: dict[str, Callable[[Any], bytes]] = {"stdlib": stdlib_dumps, "orjson": orjson.dumps,
                                            "msgspec": _MSGSPEC_ENCODER.encode}
LOADS: dict[str, Callable[[bytes], Any]] = {"stdlib": json.loads, "orjson": orjson.loads,
                                            "msgspec": _MSGSPEC_DECODER.decode}


def chat_messages() -> list[dict[str, str]]:
    """About 2 KB of chat: a system prompt and a user turn with non-ASCII text."""
    system = "You are a helpful assistant running on a small edge box. Answer briefly and precisely. " * 4
    user = "Summarise the weather report for Zürich, Köln and 東京 in two sentences; keep the units (°C). " * 16
    return [{"role": "system", "content": system.strip()}, {"role": "user", "content": user.strip()}]


def payloads() -> dict[str, list[Any]]:
    """Each workload's values, as the appliance builds them; a workload's operation handles all of them."""
    token = StreamToken(task_id="task-1", text=" the", token_id=279, timestamp=1764650000.125).to_payload()
    done = TaskComplete(task_id="task-1", text=" the", usage=Usage(prompt_tokens=24, completion_tokens=1),
                        stop_reason="length", timings={"ttft_ms": 12.5, "total_ms": 13.25},
                        stats={"plan": "S", "threads": 2}).to_payload()
    messages = chat_messages()
    body = {"model": "demo", "messages": messages, "max_tokens": 64, "temperature": 0.7, "stream": True}
    infer = InferRequest(task_id="task-1", model="demo", max_tokens=64, temperature=0.7, stream=True,
                         messages=tuple(ChatMessage(role=m["role"], content=m["content"]) for m in messages))
    chunk = openai_schema.chat_chunk("chatcmpl-5f0c2a9e1b7d4c3a", 1764650000, "demo", {"content": " the"}, None,
                                     False)
    reply = openai_schema.chat_completion("chatcmpl-5f0c2a9e1b7d4c3a", 1764650000, "demo",
                                          {"role": "assistant", "content": "The weather is mild: 12 °C in Zürich."},
                                          "stop", openai_schema.usage(420, 12, 0), None)
    return {"token_frame": [token, done], "sse_chunk": [chunk], "chat_body": [body],
            "infer_frame": [infer.to_payload()], "chat_reply": [reply]}


OPERATIONS = (("token_frame", "encode"), ("token_frame", "decode"), ("sse_chunk", "encode"),
              ("chat_body", "decode"), ("infer_frame", "encode"), ("chat_reply", "encode"))
"""(workload, direction): what one round times for each codec."""


def operation(codec: str, direction: str, values: Sequence[Any]) -> Callable[[], None]:
    """One call of the operation: every value of the workload encoded, or decoded from the stdlib's bytes."""
    if direction == "encode":
        dumps = DUMPS[codec]

        def encode() -> None:
            for value in values:
                dumps(value)
        return encode
    loads = LOADS[codec]
    texts = [stdlib_dumps(value) for value in values]

    def decode() -> None:
        for text in texts:
            loads(text)
    return decode


def check_agreement(work: dict[str, list[Any]]) -> list[str]:
    """Where a codec's output does not decode to the stdlib's value (nothing, when they agree)."""
    problems = []
    for workload, values in work.items():
        for value in values:
            expected = json.loads(stdlib_dumps(value))
            for codec in CODECS:
                if json.loads(DUMPS[codec](value)) != expected:
                    problems.append(f"{codec} encodes {workload} differently")
                if LOADS[codec](stdlib_dumps(value)) != expected:
                    problems.append(f"{codec} decodes {workload} differently")
            if json.loads(jsoncodec.dumps(value)) != expected or jsoncodec.loads(stdlib_dumps(value)) != expected:
                problems.append(f"appliance.protocol.jsoncodec disagrees on {workload}")
    return problems


def time_call(call: Callable[[], None], calls: int) -> float:
    """Mean seconds of one call over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def measure(work: dict[str, list[Any]], rounds: int, calls: int, seed: int) -> list[dict[str, dict[str, float]]]:
    """Per round, per ``workload/direction``, per codec: microseconds per call; codecs in a fresh random order."""
    rng = random.Random(seed)
    results = []
    for _ in range(rounds):
        row: dict[str, dict[str, float]] = {}
        for workload, direction in OPERATIONS:
            order = list(CODECS)
            rng.shuffle(order)
            timed = {}
            for codec in order:
                call = operation(codec, direction, work[workload])
                call()  # warm
                timed[codec] = time_call(call, calls) * 1e6
            row[f"{workload}/{direction}"] = {codec: timed[codec] for codec in CODECS}
        results.append(row)
    return results


def summarise(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Median microseconds per codec and each codec's speed-up over the stdlib (stdlib time / its time)."""
    summary = {}
    for key in rows[0]:
        medians = {codec: statistics.median(row[key][codec] for row in rows) for codec in CODECS}
        summary[key] = {**{f"{codec}_us": medians[codec] for codec in CODECS},
                        **{f"{codec}_speedup": medians["stdlib"] / medians[codec] for codec in CODECS[1:]}}
    return summary


def headline(summary: dict[str, dict[str, float]], rounds: int, others_share: float) -> str:
    def part(key: str, label: str) -> str:
        row = summary[key]
        return (f"{label} stdlib {row['stdlib_us']:.1f} us, orjson {row['orjson_speedup']:.1f}x, "
                f"msgspec {row['msgspec_speedup']:.1f}x")
    return ("HEADLINE: codec (per call, medians of " + str(rounds) + " rounds): "
            + "; ".join([part("token_frame/encode", "1-token MAGN reply encode"),
                         part("token_frame/decode", "decode"),
                         part("sse_chunk/encode", "SSE chunk encode"),
                         part("chat_body/decode", "2 KB chat body decode")])
            + f"; the appliance uses {CHOSEN}"
            + (f"; NOISY: other processes used {others_share:.0%} of the CPU" if others_share > NOISY_SHARE else ""))


def print_table(result: dict[str, Any]) -> None:
    print(f"{'operation':24} {'stdlib us':>10} {'orjson us':>10} {'msgspec us':>11} {'orjson':>7} {'msgspec':>8}")
    for key, row in result["summary"].items():
        print(f"{key:24} {row['stdlib_us']:10.2f} {row['orjson_us']:10.2f} {row['msgspec_us']:11.2f} "
              f"{row['orjson_speedup']:6.1f}x {row['msgspec_speedup']:7.1f}x")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (5; quick 1)")
    p.add_argument("--calls", type=int, default=None, help="calls per codec per operation per round (20000; quick 200)")
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, {"rounds": 5, "calls": 20000}, {"rounds": 1, "calls": 200})
    load = BoxLoad()
    work = payloads()
    problems = check_agreement(work)
    rows = measure(work, args.rounds, args.calls, args.seed)
    summary = summarise(rows)
    box = load.figures()
    sizes = {workload: sum(len(stdlib_dumps(value)) for value in values) for workload, values in work.items()}
    result = {"name": NAME, "machine": machine(), "quick": args.quick, "rounds": rows, "calls": args.calls,
              "payload_bytes": sizes, "summary": summary, "chosen": CHOSEN, "problems": problems,
              "versions": {"orjson": orjson.__version__, "msgspec": msgspec.__version__}, "box": box,
              "headline": headline(summary, args.rounds, box["other_processes_share_of_box"])}
    return finish(result, args.out, print_table, ok=not problems)


if __name__ == "__main__":
    sys.exit(main())

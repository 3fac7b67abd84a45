"""Durable agents (issue #24): what a restart costs an agent with and without its KV state on disk, and what the
agents' store adds to every decode.

**1. Restart to first token, disk restore vs re-evaluation.** One agent with a ``--tokens`` (2000) token
conversation on the 12x768 f16 model (``n_ctx`` 4096), through ``appliance run`` as its own process (``device:
fake:8GiB``, ``http: {port: 0}``, ``engine.adaptive: false`` and ``engine.threads: 1`` (``--threads``), so that
both paths run with the same threads: the adaptive engine picks them from a CPU reading that moves between restarts,
and picked 1 in every recorded run on the busy 2-core development box; 1 thread also stays steady beside other
sessions' work, where 2 OpenMP threads beside one busy process ran 15x slower, ``contention.py``). Two
state folders, one per variant, each built once: start, ``REGISTER a m``, one long-prompt ``DECODE a 8 <prompt>``,
SIGTERM (the disk variant writes ``kv/a.kv`` then). The variants differ in one setting:

* **disk**: ``disk_kv_budget`` at its default (``auto``): the restarted agent's next decode reads its KV file back
  (``kv_restored_from=disk`` in the DECODE reply);
* **tokens**: ``disk_kv_budget: 0``: nothing is written at SIGTERM; the agent's tokens are re-evaluated
  (``kv_restored_from=tokens``).

A round restarts each variant once (the order alternated per round): ``appliance run`` is started (the clock starts
just before the process is spawned), *ready* when its registry file names its pid; then ``DECODE a 1`` (no prompt:
the conversation continues; one token, so the reply is the first token), timed on the client from the request sent to
the whole reply read; then SIGTERM, timed to the process's exit (the disk variant writes its KV file again then). The
reply's ``kv_restored_from`` must be the variant's (else the run stops: it would measure the wrong path), and both
variants' continuations are compared (the same conversation, greedy: the same token). The first decode also loads
the model (dormant agents hold none: its check in a child process, then the load), the same for both variants; its
time is read from the ``model m loaded: …, N s`` log line (best effort) and the decode's time less it is reported
beside. Before a disk restart the KV
file's pages are dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, best effort; ``--warm-kv``
keeps them, as a quick ``systemctl restart`` would find them), so the figure is the conservative one. The model file
stays in the page cache for both. Beside it, after each disk round: the raw read time of ``kv/a.kv`` (dropped from
the cache first, then again warm) and the checked read the daemon does (``kvfiles.read``: header, tokens digest,
CRC-32), cold.

**2. The store's write cost.** Measured in-process (two ``Daemon`` s, not two appliance processes: there is no
setting that turns the store off, and in-process the store's part is timed exactly instead of being the difference of
two noisy end-to-end medians). ``--agents`` (4) line agents on the 4x256 f16 model each decode ``--decodes`` (20)
turns of ``--decode-tokens`` (4) greedy tokens after an 8-word prompt, all agents' turns at once (one batch), after an
untimed warm-up turn. Two daemons per round, the order alternated: **store** (``attach_durability(StoreWriter(
AgentStore(path)), None)``, what ``appliance run`` attaches, without the disk tier) and **none** (no store). A decode
awaits its commit before it returns, so the store's added latency per decode is that commit's wait, timed around
:meth:`StoreWriter.commit` (a subclass); the client-side per-decode latency with and without the store is the
cross-check. Commits per transaction (batching: commits that arrive while a transaction runs go in the next one) and
writes per transaction come from the writer's counters; bytes per commit are what the writer thread passed to
``write()`` (``/proc/self/task/<tid>/io`` ``wchar``: SQLite's WAL frames, 4 KiB pages plus headers, and the
checkpoints), beside the row's own payload (the tokens as int32 and the text fields). Then the same
:class:`StoreWriter` alone on records of a 2000-token agent (8 KB of tokens), one commit at a time and
``--agents`` at once, ``--direct-commits`` commits each.

Exit 1 when a restart's tier was not the variant's (the run stops there) or a decode failed.
Run ``python -m benchmarks.durable`` (``--quick``: the 4x256 model, a 200-token conversation, 2 rounds, 2 agents x 3
decodes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from appliance.benchmark.servers import SOURCE_ROOT, START_TIMEOUT_S
from appliance.benchmark.session import PROMPT_WORDS, percentile
from appliance.client import lines as lineclient
from appliance.config.validate import parse_config
from appliance.daemon import kvfiles, registry
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.daemon.store import FILE_NAME, AgentRecord, AgentStore, PutAgent, StoreWriter, Write, pack_tokens
from appliance.engine.runtime import Engine
from benchmarks.common import (
    NOISY_SHARE,
    BoxLoad,
    add_output_args,
    fill_defaults,
    finish,
    machine,
    tiny_model,
)

NAME = "durable"
MODEL = "m"
AGENT = "a"
BUILD_TOKENS = 8
"""Tokens generated by the decode that builds the conversation."""
TURN_WORDS = 8
"""Words (one token each) of a store-cost turn's prompt."""
DIRECT_TOKENS = 2000
"""Tokens of an agent record in the direct commit series (a 2k-token agent)."""
REQUEST_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 120.0
MAX_LINE = 60_000
"""Longest DECODE line sent (the line protocol's limit is 64 KiB)."""

FULL = {"layers": 12, "dim": 768, "tokens": 2000, "n_ctx": 4096, "rounds": 5, "agents": 4, "decodes": 20,
        "store_rounds": 5, "direct_commits": 200}
QUICK = {"layers": 4, "dim": 256, "tokens": 200, "n_ctx": 1024, "rounds": 2, "agents": 2, "decodes": 3,
         "store_rounds": 2, "direct_commits": 20}


class WrongTier(RuntimeError):
    """A restarted agent's state did not come from where its variant says: the measurement would be of another
    path."""


@dataclass(frozen=True)
class Variant:
    """One way to restart: its ``disk_kv_budget`` and the ``kv_restored_from`` its first decode must report."""

    name: str
    disk_kv_budget: str | int
    expect: str


VARIANTS = (Variant("disk", "auto", "disk"), Variant("tokens", 0, "tokens"))


# -- 1. restart to first token --------------------------------------------------------------------------------------


def restart_config(model: Path, state: Path, variant: Variant, n_ctx: int, threads: int) -> str:
    return yaml.safe_dump({
        "data_dir": str(state), "device": "fake:8GiB", "model_dirs": [str(model.parent)],
        "socket": {"path": str(state / "a.sock")}, "http": {"host": "127.0.0.1", "port": 0},
        "resync_interval_s": 0, "log_level": "info", "disk_kv_budget": variant.disk_kv_budget,
        "engine": {"adaptive": False, "threads": threads},
        "models": [{"name": MODEL, "path": str(model), "n_ctx": n_ctx, "idle_ttl_s": 0}],
    }, sort_keys=False)


def conversation_prompt(n_tokens: int, seed: int = 0) -> str:
    """``n_tokens - 1`` words of the tiny vocabulary (one token each): ``n_tokens`` tokens with BOS."""
    rng = random.Random(seed)
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(n_tokens - 1))


class Server:
    """One ``appliance run`` process on a state folder: started and timed to ready, asked, stopped and timed."""

    def __init__(self, state: Path, label: str) -> None:
        self.state = state
        self.log = state / f"appliance-{label}.log"
        path = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        with open(self.log, "wb") as out:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config",
                                          str(state / "appliance.yaml")], cwd=SOURCE_ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        self.ready_s = self._wait_ready()

    def _wait_ready(self) -> float:
        """Seconds from the spawn to the registry file naming this process (written once it serves)."""
        deadline = self.started + START_TIMEOUT_S
        path = registry.path(self.state)
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                if json.loads(path.read_text())["pid"] == self.proc.pid:
                    return time.perf_counter() - self.started
            if self.proc.poll() is not None:
                raise RuntimeError(f"appliance run exited with {self.proc.returncode}:\n{self.tail()}")
            if time.perf_counter() > deadline:
                self.kill()
                raise RuntimeError(f"appliance run was not ready in {START_TIMEOUT_S:.0f} s:\n{self.tail()}")
            time.sleep(0.005)

    def request(self, line: str) -> tuple[str, float]:
        """One line-protocol command; the reply and the seconds from sending it to the whole reply read."""
        sent = time.perf_counter()
        reply = lineclient.request(self.state / "a.sock", line, timeout=REQUEST_TIMEOUT_S)
        return reply, time.perf_counter() - sent

    def stop(self) -> float:
        """SIGTERM; seconds to the process's exit (which must be 0)."""
        sent = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"appliance run did not stop within {STOP_TIMEOUT_S:.0f} s of SIGTERM:\n"
                               f"{self.tail()}") from None
        if code != 0:
            raise RuntimeError(f"appliance run exited with {code} after SIGTERM:\n{self.tail()}")
        return time.perf_counter() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""


def decode_fields(reply: str, server: Server) -> dict[str, str]:
    fields = lineclient.header_fields(reply)
    if not reply.startswith("OK") or "kv_restored_from" not in fields:
        raise RuntimeError(f"DECODE failed: {reply.strip()[:500]}\n{server.tail()}")
    return fields


def build(model: Path, state: Path, variant: Variant, args: argparse.Namespace, prompt: str) -> dict[str, Any]:
    """The variant's state folder with agent ``a``'s conversation in it, the appliance stopped (SIGTERM)."""
    (state / "appliance.yaml").write_text(restart_config(model, state, variant, args.n_ctx, args.threads))
    server = Server(state, "build")
    try:
        reply, _ = server.request(f"REGISTER {AGENT} {MODEL}")
        if not reply.startswith("OK"):
            raise RuntimeError(f"REGISTER failed: {reply.strip()}\n{server.tail()}")
        reply, seconds = server.request(f"DECODE {AGENT} {BUILD_TOKENS} {prompt}")
        fields = decode_fields(reply, server)
        stop_s = server.stop()
    finally:
        server.kill()
    kv = state / "kv" / f"{AGENT}.kv"
    if kv.exists() != (variant.name == "disk"):
        raise WrongTier(f"{variant.name}: after the build's SIGTERM kv/{AGENT}.kv "
                        f"{'exists' if kv.exists() else 'is missing'}\n{server.tail()}")
    return {"prompt_tokens": int(fields["prompt_tokens"]), "generated_tokens": int(fields["generated_tokens"]),
            "prefill_ttft_ms": float(fields["ttft_ms"]), "seconds": seconds, "stop_s": stop_s,
            "kv_restored_from": fields["kv_restored_from"]}


def drop_cache(path: Path) -> bool:
    """Ask the kernel to drop ``path``'s pages from the page cache (best effort); whether the call succeeded."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def raw_read_s(path: Path) -> float:
    """Seconds to read the whole file into a preallocated buffer."""
    buffer = bytearray(path.stat().st_size)
    view = memoryview(buffer)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        done = 0
        while done < len(buffer):
            got = fh.readinto(view[done:])
            if not got:
                break
            done += got
    return time.perf_counter() - started


def checked_read_s(path: Path, tokens: Sequence[int]) -> float:
    """Seconds of the daemon's own read (:func:`appliance.daemon.kvfiles.read`: header, digest, CRC-32)."""
    with open(path, "rb") as fh:
        validity = kvfiles.read_header(fh).validity
    started = time.perf_counter()
    kvfiles.read(path, validity, tokens)
    return time.perf_counter() - started


def stored_tokens(state: Path) -> tuple[int, ...]:
    store = AgentStore(state / FILE_NAME)
    try:
        return next(record.tokens for record in store.load_agents() if record.id == AGENT)
    finally:
        store.close()


def read_figures(state: Path) -> dict[str, Any]:
    """The KV file's size and read times (the appliance is stopped)."""
    path = state / "kv" / f"{AGENT}.kv"
    dropped = drop_cache(path)
    cold = raw_read_s(path)
    warm = raw_read_s(path)
    tokens = stored_tokens(state)
    drop_cache(path)
    checked = checked_read_s(path, tokens)
    return {"bytes": path.stat().st_size, "raw_cold_s": cold, "raw_warm_s": warm, "checked_cold_s": checked,
            "cache_dropped": dropped}


def restart(state: Path, variant: Variant, label: str, warm_kv: bool) -> dict[str, Any]:
    """One restart: spawn to ready, ``DECODE a 1``, SIGTERM to exit."""
    dropped = None
    if variant.name == "disk" and not warm_kv:
        dropped = drop_cache(state / "kv" / f"{AGENT}.kv")
    server = Server(state, label)
    try:
        reply, decode_s = server.request(f"DECODE {AGENT} 1")
        first_token_s = time.perf_counter() - server.started
        fields = decode_fields(reply, server)
        if fields["kv_restored_from"] != variant.expect:
            raise WrongTier(f"{variant.name}: the restarted agent's decode says kv_restored_from="
                            f"{fields['kv_restored_from']}, not {variant.expect}:\n{reply.strip()}\n{server.tail()}")
        stop_s = server.stop()
    finally:
        server.kill()
    load = model_load_s(server.log)
    return {"ready_s": server.ready_s, "decode_s": decode_s, "restart_to_first_token_s": first_token_s,
            "ttft_ms": float(fields["ttft_ms"]), "elapsed_ms": float(fields["elapsed_ms"]),
            "outside_generation_ms": decode_s * 1e3 - float(fields["elapsed_ms"]), "model_load_s": load,
            "decode_less_load_ms": None if load is None else (decode_s - load) * 1e3, "stop_s": stop_s,
            "kv_restored_from": fields["kv_restored_from"], "kv_swap_restored": fields["kv_swap_restored"],
            "prompt_evaluated": int(fields["prompt_evaluated"]), "text": lineclient.response_body(reply),
            "kv_cache_dropped": dropped}


def model_load_s(log: Path) -> float | None:
    """The model's load time as its log line says (``model m loaded: …, 0.70 s``: its check in a child process and
    the load), best effort: None when the line is not there."""
    with contextlib.suppress(OSError):
        found = re.search(rf"model {MODEL} loaded: [^\n]*?, ([0-9.]+) s\b", log.read_text(errors="replace"))
        if found:
            return float(found.group(1))
    return None


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def median_of(samples: Iterable[dict[str, Any]], key: str) -> float | None:
    values = [sample[key] for sample in samples if sample[key] is not None]
    return statistics.median(values) if values else None


def restarts(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, n_ctx_train=max(args.n_ctx, 4096))
    prompt = conversation_prompt(args.tokens)
    if len(prompt) + 64 > MAX_LINE:
        raise SystemExit(f"--tokens {args.tokens}: the DECODE line would pass the line protocol's 64 KiB")
    root = Path(tempfile.mkdtemp(prefix="ap-dur-"))  # short: AF_UNIX socket paths are limited to 108 bytes
    states = {v.name: root / v.name for v in VARIANTS}
    try:
        built = {}
        for variant in VARIANTS:
            states[variant.name].mkdir()
            print(f"building the {args.tokens}-token conversation ({variant.name}) ...", flush=True)
            built[variant.name] = build(model, states[variant.name], variant, args, prompt)
        samples: dict[str, list[dict[str, Any]]] = {v.name: [] for v in VARIANTS}
        reads: list[dict[str, Any]] = []
        for index in range(args.rounds):
            order = VARIANTS if index % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                sample = restart(states[variant.name], variant, f"r{index}", args.warm_kv)
                sample["round"] = index
                samples[variant.name].append(sample)
                print(f"  round {index + 1}/{args.rounds} {variant.name}: ready {sample['ready_s']:.2f} s, first "
                      f"token {sample['restart_to_first_token_s']:.2f} s (decode {sample['decode_s'] * 1e3:.0f} ms, "
                      f"kv_restored_from={sample['kv_restored_from']}), stop {sample['stop_s']:.2f} s", flush=True)
                if variant.name == "disk":
                    reads.append(read_figures(states["disk"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = ("ready_s", "decode_s", "restart_to_first_token_s", "ttft_ms", "elapsed_ms", "outside_generation_ms",
            "model_load_s", "decode_less_load_ms", "stop_s")
    medians = {name: {key: median_of(rows, key) for key in keys} for name, rows in samples.items()}
    paired = [t["restart_to_first_token_s"] / d["restart_to_first_token_s"]
              for d, t in zip(samples["disk"], samples["tokens"], strict=True)]
    texts = [(d["text"], t["text"]) for d, t in zip(samples["disk"], samples["tokens"], strict=True)]
    return {
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16", "n_ctx": args.n_ctx},
        "threads": args.threads, "conversation_tokens": built["disk"]["prompt_tokens"] + BUILD_TOKENS,
        "rounds": args.rounds, "kv_page_cache": "kept" if args.warm_kv else "dropped before each disk restart",
        "variants": {v.name: {"disk_kv_budget": v.disk_kv_budget, "expect_kv_restored_from": v.expect}
                     for v in VARIANTS},
        "build": built, "samples": samples, "medians": medians,
        "ratio_tokens_to_disk": {
            "restart_to_first_token": (medians["tokens"]["restart_to_first_token_s"]
                                       / medians["disk"]["restart_to_first_token_s"]),
            "decode": medians["tokens"]["decode_s"] / medians["disk"]["decode_s"],
            "decode_less_load": ratio(medians["tokens"]["decode_less_load_ms"], medians["disk"]["decode_less_load_ms"]),
            "restart_to_first_token_paired_median": statistics.median(paired)},
        "tiers_as_expected": all(s["kv_restored_from"] == v.expect for v in VARIANTS for s in samples[v.name]),
        "continuations_equal": all(a == b for a, b in texts),
        "kv_file": {"bytes": reads[-1]["bytes"], "raw_cold_s": median_of(reads, "raw_cold_s"),
                    "raw_warm_s": median_of(reads, "raw_warm_s"), "checked_cold_s": median_of(reads, "checked_cold_s"),
                    "cache_dropped": all(r["cache_dropped"] for r in reads), "reads": reads},
    }


# -- 2. the store's write cost ------------------------------------------------------------------------------------


def thread_wchar(native_id: int | None) -> int | None:
    """Bytes the thread passed to ``write()`` so far (``/proc/self/task/<tid>/io``), None where unreadable."""
    if native_id is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/self/task/{native_id}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return None


def payload_bytes(write: Write) -> int:
    """An agent row's own bytes: its tokens as int32 and its fields (what SQLite is handed, before pages)."""
    if not isinstance(write, PutAgent):
        return 0
    r = write.record
    text = [r.id, r.model, r.model_file, r.vocabulary, r.owner, r.kv, r.kv_file or ""]
    return len(pack_tokens(r.tokens)) + sum(len(t.encode()) for t in text) + 2 * 8


class TimedWriter(StoreWriter):
    """The daemon's :class:`StoreWriter`, with each awaited commit timed (the latency it adds to its decode)."""

    def __init__(self, store: AgentStore) -> None:
        super().__init__(store)
        self.waits: list[float] = []
        self.payload = 0

    async def commit(self, writes: Iterable[Write]) -> bool:
        writes = list(writes)
        started = time.perf_counter()
        ok = await super().commit(writes)
        self.waits.append(time.perf_counter() - started)
        self.payload += sum(payload_bytes(write) for write in writes)
        return ok

    @property
    def native_id(self) -> int | None:
        thread = getattr(self, "_thread", None)
        return getattr(thread, "native_id", None)

    def mark(self) -> dict[str, Any]:
        return {"commits": len(self.waits), "transactions": self.transactions, "writes": self.writes,
                "commit_seconds": self.commit_seconds, "payload": self.payload,
                "wchar": thread_wchar(self.native_id)}


def batching(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Commits, transactions and bytes between two :meth:`TimedWriter.mark` s."""
    commits = after["commits"] - before["commits"]
    transactions = after["transactions"] - before["transactions"]
    wchar = (None if after["wchar"] is None or before["wchar"] is None else after["wchar"] - before["wchar"])
    return {"commits": commits, "transactions": transactions, "writes": after["writes"] - before["writes"],
            "transaction_seconds": after["commit_seconds"] - before["commit_seconds"],
            "payload_bytes": after["payload"] - before["payload"], "written_bytes": wchar}


def store_config(model: Path, state: Path, args: argparse.Namespace) -> Any:
    doc = {"data_dir": str(state), "device": "fake:8GiB", "model_dirs": [str(model.parent)], "resync_interval_s": 0,
           "engine": {"adaptive": False, "threads": args.threads, "live_slots": max(4, args.agents)},
           "models": [{"name": MODEL, "path": str(model), "n_ctx": 2048, "idle_ttl_s": 0}]}
    return parse_config(yaml.safe_dump(doc), base_dir=state)


def turn_prompt(rng: random.Random) -> str:
    return " " + " ".join(rng.choice(PROMPT_WORDS) for _ in range(TURN_WORDS))


async def store_session(model: Path, state: Path, args: argparse.Namespace, with_store: bool) -> dict[str, Any]:
    """``args.agents`` agents x ``args.decodes`` timed decodes on one daemon, with the store or without."""
    daemon = Daemon(store_config(model, state, args), FakeDevice("8GiB", process_used=0), Engine(args.threads))
    writer = TimedWriter(AgentStore(state / FILE_NAME)) if with_store else None
    daemon.attach_durability(writer, None)
    rng = random.Random(1)
    names = [f"agent{i}" for i in range(args.agents)]
    latencies: list[float] = []
    failures: list[str] = []

    async def timed(name: str, prompt: str) -> float:
        started = time.perf_counter()
        result = await daemon.decode(name, args.decode_tokens, prompt)
        seconds = time.perf_counter() - started
        if result.generation.stop_reason == "cancelled":
            failures.append(f"{name}: cancelled")
        return seconds

    try:
        for name in names:
            await daemon.register(name, MODEL)
        await asyncio.gather(*(timed(name, turn_prompt(rng)) for name in names))  # untimed warm-up turn
        before = writer.mark() if writer is not None else None
        first_wait = len(writer.waits) if writer is not None else 0
        for _ in range(args.decodes):
            latencies += await asyncio.gather(*(timed(name, turn_prompt(rng)) for name in names))
        after = writer.mark() if writer is not None else None
        tokens = max(len(agent.conversation.tokens) for agent in daemon.agents.values())
    finally:
        await daemon.close()
    result: dict[str, Any] = {"store": with_store, "latencies_s": latencies, "failures": failures,
                              "conversation_tokens_at_end": tokens}
    if writer is not None and before is not None and after is not None:
        result["commit_waits_s"] = writer.waits[first_wait:]
        result["batching"] = batching(before, after)
    return result


def agent_record(name: str, tokens: tuple[int, ...]) -> AgentRecord:
    now = time.time()
    return AgentRecord(name, MODEL, "2049:1234567:74010698:1764642000000000000", "0" * 32, "client", now, now,
                       tokens, "device", None)


async def direct_series(state: Path, commits: int, at_once: int) -> dict[str, Any]:
    """``commits`` commits of 2000-token agent records, ``at_once`` awaited together."""
    writer = TimedWriter(AgentStore(state / FILE_NAME))
    rng = random.Random(2)
    base = [rng.randrange(32000) for _ in range(DIRECT_TOKENS)]
    try:
        await writer.commit([PutAgent(agent_record(f"agent{j}", tuple(base))) for j in range(at_once)])  # rows exist
        before = writer.mark()
        for step in range(commits // at_once):
            base[step % DIRECT_TOKENS] = rng.randrange(32000)  # each commit's tokens differ
            await asyncio.gather(*(writer.commit([PutAgent(agent_record(f"agent{j}", tuple(base)))])
                                   for j in range(at_once)))
        after = writer.mark()
        waits = writer.waits[1:]
    finally:
        await asyncio.to_thread(writer.close)
    return {"at_once": at_once, "record_tokens": DIRECT_TOKENS, "commit_waits_s": waits,
            "batching": batching(before, after)}


def store_summary(waits: Sequence[float], counts: dict[str, Any]) -> dict[str, Any]:
    commits = counts["commits"] or 1
    transactions = counts["transactions"] or 1
    written = counts["written_bytes"]
    return {"commit_wait_median_ms": statistics.median(waits) * 1e3, "commit_wait_p99_ms": percentile(waits, 99) * 1e3,
            "commits": counts["commits"], "transactions": counts["transactions"],
            "commits_per_transaction": counts["commits"] / transactions,
            "writes_per_transaction": counts["writes"] / transactions,
            "transaction_ms": counts["transaction_seconds"] / transactions * 1e3,
            "payload_bytes_per_commit": counts["payload_bytes"] / commits,
            "written_bytes_per_commit": None if written is None else written / commits,
            "written_bytes_per_transaction": None if written is None else written / transactions}


def add_counts(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    keys = ("commits", "transactions", "writes", "transaction_seconds", "payload_bytes")
    total: dict[str, Any] = {key: sum(row[key] for row in rows) for key in keys}
    written = [row["written_bytes"] for row in rows]
    total["written_bytes"] = None if None in written else sum(written)
    return total


def store_cost(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=4, dim=256)
    sessions: dict[str, list[dict[str, Any]]] = {"store": [], "none": []}
    root = Path(tempfile.mkdtemp(prefix="ap-dur-store-"))
    try:
        for index in range(args.store_rounds):
            order = (True, False) if index % 2 == 0 else (False, True)
            for with_store in order:
                state = root / f"r{index}-{'store' if with_store else 'none'}"
                state.mkdir()
                session = asyncio.run(store_session(model, state, args, with_store))
                sessions["store" if with_store else "none"].append(session)
            print(f"  store round {index + 1}/{args.store_rounds}: per-decode median "
                  f"{statistics.median(sessions['store'][-1]['latencies_s']) * 1e3:.1f} ms with the store, "
                  f"{statistics.median(sessions['none'][-1]['latencies_s']) * 1e3:.1f} ms without", flush=True)
        direct = {}
        for at_once in (1, args.agents):
            state = root / f"direct-{at_once}"
            state.mkdir()
            direct[f"at_once_{at_once}"] = asyncio.run(direct_series(state, args.direct_commits, at_once))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    waits = [w for s in sessions["store"] for w in s["commit_waits_s"]]
    decode = {name: {"median_ms": statistics.median(statistics.median(s["latencies_s"]) for s in rows) * 1e3,
                     "p99_ms": statistics.median(percentile(s["latencies_s"], 99) for s in rows) * 1e3,
                     "decodes": sum(len(s["latencies_s"]) for s in rows)} for name, rows in sessions.items()}
    return {
        "model": {"file": model.name, "layers": 4, "dim": 256, "dtype": "f16", "n_ctx": 2048},
        "agents": args.agents, "decodes_per_agent": args.decodes, "decode_tokens": args.decode_tokens,
        "rounds": args.store_rounds,
        "conversation_tokens_at_end": max(s["conversation_tokens_at_end"] for s in sessions["store"]),
        "in_daemon": store_summary(waits, add_counts([s["batching"] for s in sessions["store"]])),
        "decode_latency": decode,
        "added_by_store_ms": {"median": decode["store"]["median_ms"] - decode["none"]["median_ms"],
                              "p99": decode["store"]["p99_ms"] - decode["none"]["p99_ms"]},
        "direct_2k_records": {key: {**store_summary(series["commit_waits_s"], series["batching"]),
                                    "at_once": series["at_once"]} for key, series in direct.items()},
        "sessions": sessions, "direct_series": direct,
        "failures": [f for rows in sessions.values() for s in rows for f in s["failures"]],
    }


# -- the run ------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load = BoxLoad()
    loadavg_start = os.getloadavg()
    print(f"1. restart to first token, {args.layers}x{args.dim}, {args.tokens}-token conversation, {args.rounds} "
          f"rounds", flush=True)
    restart = restarts(args)
    print(f"2. the store's write cost, {args.agents} agents x {args.decodes} decodes, {args.store_rounds} rounds",
          flush=True)
    store = store_cost(args)
    result: dict[str, Any] = {
        "benchmark": NAME, "quick": args.quick, "restart": restart, "store": store,
        "box_load": load.figures(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
        "run_s": time.perf_counter() - started, "machine": machine(),
        "units": "restart: seconds from spawning `appliance run` (ready: its registry names it; first token: the "
                 "reply of `DECODE a 1` read), medians over the rounds; ttft_ms/elapsed_ms: the DECODE reply's own "
                 "(engine) figures; outside_generation_ms: decode_s less elapsed_ms (the model's load and check, the "
                 "KV file's read); stop_s: SIGTERM to exit; kv_file: seconds to read kv/a.kv. store: "
                 "commit_wait = time a decode awaited its commit (added to its reply), over every timed decode; "
                 "decode_latency: client-side time of each decode, median over rounds of each round's median/p99; "
                 "written_bytes = bytes the store's writer thread passed to write() (WAL frames, checkpoints)",
    }
    result["ok"] = restart["tiers_as_expected"] and not store["failures"]
    result["headline"] = headline(result)
    return result


def size(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} KB"


def headline(r: dict[str, Any]) -> str:
    rs, st = r["restart"], r["store"]
    disk, tokens = rs["medians"]["disk"], rs["medians"]["tokens"]
    kv = rs["kv_file"]
    daemon = st["in_daemon"]
    written = daemon["written_bytes_per_commit"]
    tail = "" if rs["tiers_as_expected"] else "; TIER MISMATCH"
    if st["failures"]:
        tail += "; a decode FAILED"
    if r["box_load"]["other_processes_share_of_box"] > NOISY_SHARE:
        tail += f"; NOISY: other processes used {r['box_load']['other_processes_share_of_box']:.0%} of the CPU"
    return (f"HEADLINE: durable {rs['conversation_tokens']}-token agent {rs['model']['layers']}x{rs['model']['dim']} "
            f"f16: restart to first token {disk['restart_to_first_token_s']:.2f} s from disk vs "
            f"{tokens['restart_to_first_token_s']:.2f} s re-evaluated "
            f"({rs['ratio_tokens_to_disk']['restart_to_first_token']:.1f}x sooner; first decode "
            f"{disk['decode_s'] * 1e3:.0f} ms vs {tokens['decode_s'] * 1e3:.0f} ms, ready "
            f"{disk['ready_s']:.2f} vs {tokens['ready_s']:.2f} s); kv/a.kv {size(kv['bytes'])} read cold in "
            f"{kv['raw_cold_s'] * 1e3:.0f} ms; store +{daemon['commit_wait_median_ms']:.2f} ms per decode (p99 "
            f"{daemon['commit_wait_p99_ms']:.2f} ms), {daemon['commits_per_transaction']:.1f} commits per "
            f"transaction, {'n/a' if written is None else size(written)} written per commit{tail}")


def print_table(r: dict[str, Any]) -> None:
    rs, st = r["restart"], r["store"]
    print(f"restart: {rs['conversation_tokens']}-token conversation, {rs['model']['file']}, n_ctx "
          f"{rs['model']['n_ctx']}, {rs['threads']} threads, median of {rs['rounds']} rounds; KV file's page cache "
          f"{rs['kv_page_cache']}")
    print(f"{'variant':<8} {'kv_restored_from':>16} {'ready s':>8} {'decode ms':>10} {'first token s':>14} "
          f"{'ttft_ms':>9} {'outside ms':>10} {'load s':>7} {'less load ms':>12} {'stop s':>7}")
    for variant in VARIANTS:
        m = rs["medians"][variant.name]
        tiers = ",".join(sorted({s["kv_restored_from"] for s in rs["samples"][variant.name]}))
        load = "n/a" if m["model_load_s"] is None else f"{m['model_load_s']:.2f}"
        less = "n/a" if m["decode_less_load_ms"] is None else f"{m['decode_less_load_ms']:.1f}"
        print(f"{variant.name:<8} {tiers:>16} {m['ready_s']:>8.2f} {m['decode_s'] * 1e3:>10.1f} "
              f"{m['restart_to_first_token_s']:>14.2f} {m['ttft_ms']:>9.1f} {m['outside_generation_ms']:>10.1f} "
              f"{load:>7} {less:>12} {m['stop_s']:>7.2f}")
    print("(decode: DECODE a 1 on the client; outside: decode less the reply's elapsed_ms (the model's load and "
          "check; for disk also the KV file's read); load: the model's load as logged; less load: decode less it)")
    ratios = rs["ratio_tokens_to_disk"]
    kv = rs["kv_file"]
    less = "n/a" if ratios["decode_less_load"] is None else f"{ratios['decode_less_load']:.1f}x"
    print(f"tokens/disk: first token {ratios['restart_to_first_token']:.2f}x (paired per round "
          f"{ratios['restart_to_first_token_paired_median']:.2f}x), decode {ratios['decode']:.2f}x, decode less the "
          f"model's load {less}; continuations equal: {'yes' if rs['continuations_equal'] else 'NO'}")
    print(f"kv/a.kv {kv['bytes']} bytes: raw read cold {kv['raw_cold_s'] * 1e3:.1f} ms "
          f"({kv['bytes'] / kv['raw_cold_s'] / 1e9:.2f} GB/s; cache dropped: {kv['cache_dropped']}), warm "
          f"{kv['raw_warm_s'] * 1e3:.1f} ms, checked read (kvfiles.read) cold {kv['checked_cold_s'] * 1e3:.1f} ms")
    d = st["in_daemon"]
    print(f"store: {st['agents']} agents x {st['decodes_per_agent']} decodes of {st['decode_tokens']} tokens, "
          f"{st['model']['file']}, {st['rounds']} rounds (conversations up to {st['conversation_tokens_at_end']} "
          f"tokens)")
    print(f"{'series':<22} {'wait p50 ms':>11} {'wait p99 ms':>11} {'commits/tx':>10} {'tx ms':>7} "
          f"{'payload B':>10} {'written B':>10}")
    rows = [("in daemon", d)] + [(f"direct 2k x{v['at_once']}", v) for v in st["direct_2k_records"].values()]
    for label, row in rows:
        written = row["written_bytes_per_commit"]
        print(f"{label:<22} {row['commit_wait_median_ms']:>11.3f} {row['commit_wait_p99_ms']:>11.3f} "
              f"{row['commits_per_transaction']:>10.2f} {row['transaction_ms']:>7.3f} "
              f"{row['payload_bytes_per_commit']:>10.0f} {'n/a' if written is None else f'{written:.0f}':>10}")
    lat = st["decode_latency"]
    print(f"per-decode latency (client side) with the store {lat['store']['median_ms']:.2f} ms (p99 "
          f"{lat['store']['p99_ms']:.2f}), without {lat['none']['median_ms']:.2f} ms (p99 {lat['none']['p99_ms']:.2f}):"
          f" difference {st['added_by_store_ms']['median']:+.2f} ms (p99 {st['added_by_store_ms']['p99']:+.2f})")
    print(f"other processes used {r['box_load']['other_processes_share_of_box']:.0%} of the box's CPU; load average "
          f"{r['loadavg_start'][0]:.2f} at start, {r['loadavg_end'][0]:.2f} at end; run {r['run_s']:.0f} s")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.durable", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (4x256 model, 200 tokens, 2 rounds)")
    p.add_argument("--layers", type=int, default=None, help="restart model layers (default 12; quick 4)")
    p.add_argument("--dim", type=int, default=None, help="restart model width (default 768; quick 256)")
    p.add_argument("--tokens", type=int, default=None, help="conversation prompt tokens, BOS included (default "
                                                            "2000; quick 200)")
    p.add_argument("--n-ctx", type=int, default=None, help="the restart model's n_ctx (default 4096; quick 1024)")
    p.add_argument("--rounds", type=int, default=None, help="restart rounds (default 5; quick 2)")
    p.add_argument("--warm-kv", action="store_true", help="leave the KV file in the page cache before disk restarts")
    p.add_argument("--agents", type=int, default=None, help="store cost: agents decoding at once (default 4; "
                                                            "quick 2)")
    p.add_argument("--decodes", type=int, default=None, help="store cost: timed decodes per agent (default 20; "
                                                             "quick 3)")
    p.add_argument("--decode-tokens", type=int, default=4, help="store cost: tokens per decode")
    p.add_argument("--store-rounds", type=int, default=None, help="store cost rounds (default 5; quick 2)")
    p.add_argument("--direct-commits", type=int, default=None, help="commits per direct series (default 200; "
                                                                    "quick 20)")
    p.add_argument("--threads", type=int, default=1, help="engine.threads of both parts (default 1)")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    if (min(args.rounds, args.store_rounds, args.agents, args.decodes, args.decode_tokens, args.threads) < 1
            or args.tokens < 2 or args.direct_commits < args.agents):
        p.error("--rounds, --store-rounds, --agents, --decodes, --decode-tokens and --threads must be >= 1, "
                "--tokens >= 2, --direct-commits >= --agents")
    if args.tokens + BUILD_TOKENS + args.rounds + 16 > args.n_ctx:
        p.error(f"--tokens {args.tokens} and {args.rounds} rounds do not fit --n-ctx {args.n_ctx}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except WrongTier as exc:
        print(f"TIER MISMATCH: {exc}", file=sys.stderr)
        return 1
    return finish(result, args.out, print_table, ok=result["ok"])


if __name__ == "__main__":
    raise SystemExit(main())

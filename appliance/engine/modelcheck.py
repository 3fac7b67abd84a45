"""Model files are tried in a short-lived child process before the daemon loads them.

llama.cpp aborts the whole process (``GGML_ASSERT`` -> SIGABRT) on some malformed files, so the daemon's own
process must never be the first to load a file. :func:`check_model` first runs the bounded GGUF reader
(:func:`appliance.engine.gguf_meta.read_model_shape`, which refuses most hostile files in milliseconds), then
starts ``python -m appliance.engine.modelcheck`` on the file: the child loads it with llama-cpp-python at the
configured ``n_gpu_layers`` and a small context, evaluates a couple of tokens and prints one JSON verdict. The
parent turns a signal, a non-zero exit, a timeout or junk output into ``MODEL_LOAD_FAILED`` with a short reason
(the child's stderr is logged, never sent to a client).

Verdicts are cached for the life of the process by (resolved path, size, mtime_ns, trial n_ctx, n_gpu_layers):
a file is tried once until it changes. A timeout is not cached (the machine may just have been busy).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from appliance.engine import gguf_meta
from appliance.errors import ApplianceError

log = logging.getLogger(__name__)

TRIAL_N_CTX = 256  # the child's context: enough to evaluate a few tokens, small enough to be quick
TRIAL_PROMPT = b"Hello"
TRIAL_TOKENS = 2
TRIAL_THREADS = max(1, min(2, (os.cpu_count() or 2) // 2))  # leave the daemon's own threads some room
TRIAL_NICENESS = 10  # the child yields the CPU to the daemon that keeps serving meanwhile
TIMEOUT_S = 300.0  # a large model's first load from a cold disk can take minutes
OUTPUT_TAIL_BYTES = 8192  # what is read back of the child's stdout and stderr
REASON_CHARS = 160
CACHE_ENTRIES = 256

CacheKey = tuple[str, int, int, int, int]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one trial load. ``reason`` is short and safe to show a client."""

    ok: bool
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    cacheable: bool = True

    def raise_if_refused(self, path: Path) -> None:
        if not self.ok:
            raise ApplianceError("MODEL_LOAD_FAILED", f"cannot load {path.name}: {self.reason}",
                                 {"path": str(path), "check": "trial_load", **self.details, "reason": self.reason})


_verdicts: collections.OrderedDict[CacheKey, Verdict] = collections.OrderedDict()
_in_flight: dict[CacheKey, threading.Lock] = {}
_children: set[subprocess.Popen[bytes]] = set()  # trial children running now
_stopping: set[subprocess.Popen[bytes]] = set()  # those :func:`stop_trials` killed
_lock = threading.Lock()
stats = collections.Counter[str]()
"""``trials`` (children started) and ``cached`` (verdicts answered from the cache), for tests and benchmarks."""


def check_model(path: str | os.PathLike[str], *, n_ctx: int, n_gpu_layers: int,
                timeout_s: float = TIMEOUT_S) -> Verdict:
    """Check ``path`` before a load at ``n_ctx`` / ``n_gpu_layers``; raises ``MODEL_LOAD_FAILED`` on refusal.

    Blocking for as long as the child runs (a second on a tiny model): call it off the event loop and off the
    engine thread. Concurrent checks of the same file share one child.
    """
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ApplianceError("MODEL_LOAD_FAILED", f"cannot read model file {path}: {exc.strerror or exc}",
                             {"path": str(path)}) from exc
    trial_n_ctx = max(1, min(n_ctx, TRIAL_N_CTX))
    key: CacheKey = (str(path), stat.st_size, stat.st_mtime_ns, trial_n_ctx, n_gpu_layers)
    with _lock:
        gate = _in_flight.setdefault(key, threading.Lock())
    try:
        with gate:
            verdict = _cached(key)
            if verdict is None:
                gguf_meta.read_model_shape(path)  # the bounded reader first: most bad files never reach llama.cpp
                verdict = run_trial(trial_command(path, n_ctx=trial_n_ctx, n_gpu_layers=n_gpu_layers),
                                    timeout_s=timeout_s)
                _remember(key, verdict)
                if verdict.ok:
                    log.info("model check passed: %s (%.2f s)", path.name, verdict.elapsed_s)
                else:
                    log.warning("model check refused %s: %s", path.name, verdict.reason)
    finally:
        with _lock:
            _in_flight.pop(key, None)
    verdict.raise_if_refused(path)
    return verdict


def _cached(key: CacheKey) -> Verdict | None:
    with _lock:
        verdict = _verdicts.get(key)
        if verdict is not None:
            _verdicts.move_to_end(key)
            stats["cached"] += 1
        return verdict


def _remember(key: CacheKey, verdict: Verdict) -> None:
    with _lock:
        stats["trials"] += 1
        if not verdict.cacheable:
            return
        _verdicts[key] = verdict
        while len(_verdicts) > CACHE_ENTRIES:
            _verdicts.popitem(last=False)


def forget() -> None:
    """Drop every cached verdict (tests)."""
    with _lock:
        _verdicts.clear()


def stop_trials() -> int:
    """Kill every trial child running now (the daemon is stopping: nothing may wait for a slow one); their
    checks answer ``MODEL_LOAD_FAILED`` and cache nothing. Returns how many were killed."""
    with _lock:
        children = list(_children)
        _stopping.update(children)
    for child in children:
        with contextlib.suppress(OSError):
            child.kill()
    return len(children)


def trial_command(path: Path, *, n_ctx: int, n_gpu_layers: int) -> list[str]:
    """The child's command line."""
    return [sys.executable, "-m", "appliance.engine.modelcheck", str(path),
            "--n-ctx", str(n_ctx), "--n-gpu-layers", str(n_gpu_layers)]


def child_environment() -> dict[str, str]:
    """The daemon's environment, with this package importable and llama.cpp's abort backtrace (it runs gdb) off."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env["GGML_NO_BACKTRACE"] = "1"
    return env


def run_trial(command: list[str], *, timeout_s: float = TIMEOUT_S) -> Verdict:
    """Run a trial child and judge it: its signal, exit status and the JSON verdict on its last stdout line."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env=child_environment(), close_fds=True)
        except OSError as exc:
            log.error("model check could not start %s: %s", command[0], exc)
            return Verdict(False, "the trial load could not be started", {}, time.perf_counter() - start,
                           cacheable=False)
        with _lock:
            _children.add(proc)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return Verdict(False, f"the trial load took longer than {timeout_s:g} s", {"timeout_s": timeout_s},
                           time.perf_counter() - start, cacheable=False)
        finally:
            with _lock:
                _children.discard(proc)
                stopped = proc in _stopping
                _stopping.discard(proc)
        if stopped:
            return Verdict(False, "the trial load was stopped: the daemon is stopping", {},
                           time.perf_counter() - start, cacheable=False)
        elapsed = time.perf_counter() - start
        stdout = _tail(out)
        stderr = _tail(err)
    verdict = judge(proc.returncode, stdout, stderr, elapsed)
    if not verdict.ok:
        log.info("model check child exited %d; its stderr ends:\n%s", proc.returncode,
                 stderr.decode("utf-8", errors="replace"))
    return verdict


def judge(returncode: int, stdout: bytes, stderr: bytes, elapsed_s: float = 0.0) -> Verdict:
    """The verdict on a finished child (pure): a signal or a non-zero status is a refusal whatever it printed."""
    hint = _hint(stderr)
    if returncode < 0:
        name = _signal_name(-returncode)
        reason = f"llama.cpp crashed on it ({name})" + (f": {hint}" if hint else "")
        return Verdict(False, reason, {"signal": name}, elapsed_s)
    reply = _last_json(stdout)
    if reply is None or not isinstance(reply.get("ok"), bool):
        reason = f"the trial load exited with status {returncode} without a verdict"
        return Verdict(False, reason + (f": {hint}" if hint else ""), {"exit_code": returncode}, elapsed_s)
    if not reply["ok"]:
        said = _sanitized(str(reply.get("reason", ""))) or "no reason given"
        return Verdict(False, f"llama.cpp refused it: {hint or said}", {}, elapsed_s)
    if returncode != 0:
        return Verdict(False, f"the trial load exited with status {returncode}", {"exit_code": returncode},
                       elapsed_s)
    return Verdict(True, "", {}, elapsed_s)


def _tail(stream: IO[bytes]) -> bytes:
    size = stream.seek(0, os.SEEK_END)
    stream.seek(max(0, size - OUTPUT_TAIL_BYTES))
    return stream.read()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_json(stdout: bytes) -> dict[str, Any] | None:
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        reply = json.loads(lines[-1])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


_HINTS = (re.compile(r"(GGML_ASSERT\(.*)"), re.compile(r"error loading model: (.*)"),
          re.compile(r"(terminate called .*)"))


_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _hint(stderr: bytes) -> str:
    """The last llama.cpp assertion or load error in the child's stderr, sanitized ("" when none)."""
    for line in reversed(stderr.decode("utf-8", errors="replace").splitlines()):
        for pattern in _HINTS:
            match = pattern.search(line)
            if match:
                return _sanitized(match.group(1))
    return ""


def _sanitized(text: str) -> str:
    """One short line of printable ASCII (terminal escape sequences removed)."""
    printable = "".join(c if " " <= c <= "~" else " " for c in _ESCAPES.sub("", text))
    line = " ".join(printable.split())
    return line if len(line) <= REASON_CHARS else line[:REASON_CHARS - 3] + "..."


# -- the child ---------------------------------------------------------------------------------------
def trial_load(path: Path, *, n_ctx: int, n_gpu_layers: int) -> dict[str, Any]:
    """Load ``path`` as the daemon does (:class:`~appliance.engine.batched.ModelWeights`' parameters) and evaluate a
    couple of tokens (in the child); returns the verdict to print. llama.cpp's own log goes to stderr (the parent's
    hint)."""
    import llama_cpp  # the child's only use of llama.cpp; the parent never needs it here

    from appliance.engine.batched import EXTRA_BUFFERS

    start = time.perf_counter()
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = EXTRA_BUFFERS
    model = llama_cpp.llama_model_load_from_file(str(path).encode("utf-8"), params)
    if not model:
        return {"ok": False, "reason": "llama.cpp could not load the model"}
    try:
        n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        if n_vocab < 1:
            return {"ok": False, "reason": f"n_vocab {n_vocab}"}
        return _trial_decode(llama_cpp, model, n_ctx, n_vocab, start)
    finally:
        llama_cpp.llama_model_free(model)


def _trial_decode(llama_cpp: Any, model: Any, n_ctx: int, n_vocab: int, start: float) -> dict[str, Any]:
    """A context of ``n_ctx`` cells on ``model`` and one decode of the trial prompt's first tokens."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = min(512, n_ctx)
    params.n_threads = TRIAL_THREADS
    params.n_threads_batch = TRIAL_THREADS
    context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        return {"ok": False, "reason": "llama.cpp could not build a context"}
    try:
        if int(llama_cpp.llama_n_ctx(context)) < 1:
            return {"ok": False, "reason": f"n_ctx {llama_cpp.llama_n_ctx(context)}"}
        vocab = llama_cpp.llama_model_get_vocab(model)
        room = (llama_cpp.llama_token * 16)()
        count = int(llama_cpp.llama_tokenize(vocab, TRIAL_PROMPT, len(TRIAL_PROMPT), room, len(room), True, False))
        tokens = list(room[:max(0, min(count, TRIAL_TOKENS))]) or [0]
        batch = (llama_cpp.llama_token * len(tokens))(*tokens)
        code = int(llama_cpp.llama_decode(context, llama_cpp.llama_batch_get_one(batch, len(tokens))))
        if code != 0:
            return {"ok": False, "reason": f"llama_decode returned {code}"}
    finally:
        llama_cpp.llama_free(context)
    return {"ok": True, "n_vocab": n_vocab, "tokens": len(tokens), "elapsed_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m appliance.engine.modelcheck",
                                     description="Trial-load a GGUF model and print a JSON verdict.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--n-ctx", type=int, default=TRIAL_N_CTX)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    args = parser.parse_args(argv)
    with contextlib.suppress(OSError):
        os.nice(TRIAL_NICENESS)
    verdict_fd = os.dup(1)
    os.dup2(2, 1)  # whatever llama.cpp prints goes to stderr; stdout carries the verdict only
    try:
        reply = trial_load(args.path, n_ctx=args.n_ctx, n_gpu_layers=args.n_gpu_layers)
    except Exception as exc:  # llama-cpp-python reports a refused file as ValueError or RuntimeError
        reply = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(verdict_fd, "w") as verdict:
        verdict.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

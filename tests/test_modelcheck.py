"""The trial load in a child process: llama.cpp may abort on a bad file, the daemon's process must not.

Crafted models are real llama GGUFs (written with ``gguf.GGUFWriter`` from the tiny model's vocabulary and
tensors) with one thing wrong. Children that crash on purpose (``os.abort()``, SIGSEGV, a hang, junk output) test
how the parent judges a child, without llama.cpp.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from crafted import write_llama

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.engine import modelcheck
from appliance.engine.fake import FakeEngine, GatedEngine, ManualClock
from appliance.engine.gguf_meta import read_model_shape
from appliance.errors import ApplianceError

GiB = 1024**3


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("crafted")
    return {
        "good": write_llama(folder / "good.gguf"),
        "duplicate_token": write_llama(folder / "duplicate_token.gguf", duplicate_token=True),
        "too_many_blocks": write_llama(folder / "too_many_blocks.gguf", claims={"block_count": 1000}),
        "missing_tensor": write_llama(folder / "missing_tensor.gguf", drop_tensor="blk.1.ffn_up.weight"),
    }


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    modelcheck.forget()


def refusal_of(path: Path, **kwargs: Any) -> ApplianceError:
    with pytest.raises(ApplianceError) as info:
        modelcheck.check_model(path, n_ctx=kwargs.pop("n_ctx", 512), n_gpu_layers=kwargs.pop("n_gpu_layers", 0),
                               **kwargs)
    error = info.value
    assert error.code == "MODEL_LOAD_FAILED"
    assert error.details["path"] == str(path.resolve())
    assert "\n" not in error.message and len(error.message) < 400
    return error


def python_child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# -- the child on real llama.cpp ---------------------------------------------------------------------------------

def test_a_good_model_passes_once_and_then_from_the_cache(crafted: dict[str, Path]) -> None:
    trials, cached = modelcheck.stats["trials"], modelcheck.stats["cached"]
    verdict = modelcheck.check_model(crafted["good"], n_ctx=2048, n_gpu_layers=0)
    assert verdict.ok and verdict.elapsed_s > 0
    assert modelcheck.stats["trials"] == trials + 1
    start = time.perf_counter()
    again = modelcheck.check_model(crafted["good"], n_ctx=4096, n_gpu_layers=0)  # same trial context (capped)
    assert again is verdict
    assert time.perf_counter() - start < 0.5
    assert (modelcheck.stats["trials"], modelcheck.stats["cached"]) == (trials + 1, cached + 1)
    modelcheck.check_model(crafted["good"], n_ctx=2048, n_gpu_layers=1)  # other settings: another trial
    assert modelcheck.stats["trials"] == trials + 2


def test_a_changed_file_is_tried_again(crafted: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(crafted["good"].read_bytes())
    modelcheck.check_model(path, n_ctx=256, n_gpu_layers=0)
    trials = modelcheck.stats["trials"]
    path.write_bytes(crafted["duplicate_token"].read_bytes())  # replaced in place: new size or mtime
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert "SIGABRT" in refusal_of(path).message
    assert modelcheck.stats["trials"] == trials + 1


def test_a_file_that_aborts_llama_cpp_is_refused_and_we_survive(crafted: dict[str, Path]) -> None:
    """Two vocabulary entries with the same text: the bounded reader has no objection, llama.cpp aborts."""
    path = crafted["duplicate_token"]
    assert read_model_shape(path).layers == 2
    error = refusal_of(path)
    assert error.details["signal"] == "SIGABRT" and error.details["check"] == "trial_load"
    assert error.details["reason"].startswith("llama.cpp crashed on it (SIGABRT): GGML_ASSERT(")
    assert "llama.cpp crashed on it (SIGABRT)" in error.message
    assert "GGML_ASSERT(" in error.message and "/tmp/" not in error.message  # the assertion, not the source path
    trials = modelcheck.stats["trials"]
    refusal_of(path)  # the refusal is cached too: a client repeating it starts no more children
    assert modelcheck.stats["trials"] == trials


def test_the_child_alone_turns_an_abort_into_a_verdict(crafted: dict[str, Path]) -> None:
    """block_count 1000: the reader refuses it first; run the child on it directly, as if the reader had not."""
    command = modelcheck.trial_command(crafted["too_many_blocks"], n_ctx=256, n_gpu_layers=0)
    verdict = modelcheck.run_trial(command, timeout_s=120)
    assert not verdict.ok
    assert verdict.details == {"signal": "SIGABRT"}
    assert "LLAMA_MAX_LAYERS" in verdict.reason


def test_the_bounded_reader_refuses_before_any_child(crafted: dict[str, Path]) -> None:
    trials = modelcheck.stats["trials"]
    error = refusal_of(crafted["too_many_blocks"])
    assert error.details["limit"] == 512 and "check" not in error.details
    assert modelcheck.stats["trials"] == trials


def test_a_file_llama_cpp_refuses_cleanly_keeps_its_reason(crafted: dict[str, Path]) -> None:
    error = refusal_of(crafted["missing_tensor"])
    assert "llama.cpp refused it" in error.message and "blk.1.ffn_up.weight" in error.message
    assert "signal" not in error.details


def test_concurrent_checks_of_one_file_share_one_child(crafted: dict[str, Path]) -> None:
    trials = modelcheck.stats["trials"]
    results: list[bool] = []

    def check() -> None:
        results.append(modelcheck.check_model(crafted["good"], n_ctx=256, n_gpu_layers=0).ok)

    threads = [threading.Thread(target=check) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [True] * 4
    assert modelcheck.stats["trials"] == trials + 1


# -- judging a child -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "reason", "details"), [
    ("import os; os.abort()", "crashed on it (SIGABRT)", {"signal": "SIGABRT"}),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed on it (SIGSEGV)", {"signal": "SIGSEGV"}),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "crashed on it (SIGKILL)", {"signal": "SIGKILL"}),
    ("print('loading...'); print('<html>')", "status 0 without a verdict", {"exit_code": 0}),
    ("import sys; sys.exit(3)", "status 3 without a verdict", {"exit_code": 3}),
    ("import sys; print('{\"ok\": true}'); sys.exit(5)", "exited with status 5", {"exit_code": 5}),
    ("import json; print(json.dumps({'ok': False, 'reason': 'ValueError: bad\\nsecond\\x1b[31m line\\x07'}))",
     "llama.cpp refused it: ValueError: bad second line", {}),
])
def test_how_a_child_is_judged(code: str, reason: str, details: dict[str, Any]) -> None:
    verdict = modelcheck.run_trial(python_child(code), timeout_s=60)
    assert not verdict.ok
    assert reason in verdict.reason
    assert verdict.details == details
    assert verdict.cacheable


def test_a_child_that_hangs_is_killed_at_the_timeout_and_not_cached() -> None:
    start = time.perf_counter()
    verdict = modelcheck.run_trial(python_child("import time; time.sleep(60)"), timeout_s=1)
    assert time.perf_counter() - start < 20
    assert not verdict.ok and verdict.details == {"timeout_s": 1}
    assert "longer than 1 s" in verdict.reason
    assert not verdict.cacheable


def test_stopping_kills_running_trials_at_once() -> None:
    verdicts: list[modelcheck.Verdict] = []

    def trial() -> None:
        verdicts.append(modelcheck.run_trial(python_child("import time; time.sleep(60)"), timeout_s=120))

    thread = threading.Thread(target=trial)
    start = time.perf_counter()
    thread.start()
    deadline = time.monotonic() + 20
    while not modelcheck.stop_trials() and time.monotonic() < deadline:
        time.sleep(0.01)
    thread.join(20)
    assert time.perf_counter() - start < 20
    assert len(verdicts) == 1 and not verdicts[0].ok and not verdicts[0].cacheable
    assert "daemon is stopping" in verdicts[0].reason
    assert modelcheck.stop_trials() == 0


def test_a_good_child_and_a_noisy_stderr() -> None:
    code = "import sys; sys.stderr.write('x' * 100000 + '\\n'); print('{\"ok\": true}')"
    assert modelcheck.run_trial(python_child(code), timeout_s=60).ok


def test_the_reason_is_one_short_sanitized_line() -> None:
    stderr = b"llama_model_load: error loading model: " + b"\x1b[1m" + b"A" * 5000 + b"\nsomething else\n"
    verdict = modelcheck.judge(1, b"", stderr)
    assert verdict.reason.startswith("the trial load exited with status 1 without a verdict: AAA")
    assert len(verdict.reason) < 250 and verdict.reason.isprintable()
    assert modelcheck.judge(-6, b"", b"").reason == "llama.cpp crashed on it (SIGABRT)"
    assert modelcheck.judge(-200, b"", b"").details == {"signal": "signal 200"}
    assert modelcheck.judge(0, b'{"ok": true}\n', b"").ok


# -- the engines and the daemon ------------------------------------------------------------------------------------

def test_the_real_engine_checks_in_a_child(crafted: dict[str, Path]) -> None:
    from appliance.engine.runtime import Engine

    engine = Engine(1)
    try:
        engine.check(crafted["good"], n_ctx=256, n_gpu_layers=0)
        with pytest.raises(ApplianceError) as info:
            engine.check(crafted["duplicate_token"], n_ctx=256, n_gpu_layers=0)
        assert info.value.code == "MODEL_LOAD_FAILED" and info.value.details["signal"] == "SIGABRT"
    finally:
        engine.close()


def test_the_fake_engine_starts_no_child_and_the_gated_one_delegates(tmp_path: Path) -> None:
    trials = modelcheck.stats["trials"]
    fake = FakeEngine()
    gated = GatedEngine(fake)
    try:
        fake.check(tmp_path / "a.gguf", n_ctx=64, n_gpu_layers=0)  # the file need not even exist
        gated.check(tmp_path / "b.gguf", n_ctx=64, n_gpu_layers=0)
        assert fake.checks == [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    finally:
        gated.close()
    assert modelcheck.stats["trials"] == trials


class RefusingEngine(FakeEngine):
    """A fake engine whose check refuses one file, and notes the threads checks ran on."""

    def __init__(self, refuse: str) -> None:
        super().__init__()
        self.refuse = refuse
        self.check_threads: list[threading.Thread] = []

    def check(self, path: Path, *, n_ctx: int, n_gpu_layers: int) -> None:
        super().check(path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)
        self.check_threads.append(threading.current_thread())
        if path.name == self.refuse:
            raise ApplianceError("MODEL_LOAD_FAILED", f"cannot load {path.name}: llama.cpp crashed on it (SIGABRT)",
                                 {"path": str(path), "signal": "SIGABRT"})


def test_the_daemon_checks_before_it_reserves_and_a_refusal_reserves_nothing(tmp_path: Path) -> None:
    doc = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
           "resync_interval_s": 0,
           "models": [{"name": name, "path": str(tmp_path / f"{name}.gguf"), "vram_bytes": "1GiB"}
                      for name in ("good", "bad")]}
    config = parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)
    engine = RefusingEngine("bad.gguf")
    daemon = Daemon(config, FakeDevice("8GiB", process_used=0), engine, clock=ManualClock())

    async def body() -> None:
        try:
            with pytest.raises(ApplianceError) as info:
                await daemon.register("a1", "bad")
            assert info.value.code == "MODEL_LOAD_FAILED" and "SIGABRT" in info.value.message
            assert daemon.ledger.allocated == 0
            assert daemon.model_state("bad") == "available"
            assert engine.loads == [] and "a1" not in daemon.agents
            await daemon.register("a2", "good")
            assert daemon.ledger.allocated == GiB
            assert [p.name for p in engine.checks] == ["bad.gguf", "good.gguf"]
            assert [p.name for p in engine.loads] == ["good.gguf"]
            loop_thread = threading.current_thread()
            assert all(t is not loop_thread and t is not engine.worker_thread for t in engine.check_threads)
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(body(), 30))
    engine.close()

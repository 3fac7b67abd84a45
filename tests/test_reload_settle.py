"""Reloads of a file caught half-written (SPEC C3): the pure decision (appliance.supervisor.settle) and the reloader
that waits for the file to settle, driven with a fake applier and real writers."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from appliance.config.validate import load_config
from appliance.supervisor.plan import ReloadPlan
from appliance.supervisor.reloader import Reloader
from appliance.supervisor.settle import Decision, Effect, Read, blank, decide

# -- the decision (pure) ----------------------------------------------------------------------------------------------
FINISHED = b"models:\n  - {name: a, path: /m/a.gguf}\n"


def look(data: bytes | None, at: float, *, inode: int = 1, mtime_ns: int = 5) -> Read:
    fingerprint = None if data is None else (inode, len(data), mtime_ns, str(hash(data)))
    return Read(fingerprint, data, at)


def test_a_file_that_changed_between_the_reads_waits() -> None:
    decision = decide(look(FINISHED, 0.0), look(FINISHED + b"x: 1\n", 5.0, mtime_ns=6), Effect(valid=True))
    assert decision == Decision("wait", "the file changed while it was read")


def test_a_rewrite_with_the_same_bytes_but_a_new_mtime_waits() -> None:
    assert decide(look(FINISHED, 0.0), look(FINISHED, 5.0, mtime_ns=9), Effect(valid=True)).action == "wait"


def test_a_finished_valid_file_that_removes_nothing_applies_at_once() -> None:
    assert decide(look(FINISHED, 0.0), look(FINISHED, 0.0), Effect(valid=True), settle_s=1.0) == Decision("apply")


@pytest.mark.parametrize("data, effect, reason", [
    (FINISHED, Effect(valid=True, retired=("b",)), "it removes model b"),
    (FINISHED, Effect(valid=True, retired=("a", "b"), every_model=True), "it removes every model"),
    (FINISHED, Effect(valid=True, moved=("HTTP",)), "it moves HTTP"),
    (FINISHED, Effect(valid=False), "it is invalid"),
    (FINISHED[:-3], Effect(valid=True), "it does not end with a newline"),
    (None, Effect(valid=False), "the file cannot be read; it is invalid"),
], ids=["retires-one", "retires-all", "moves-http", "invalid", "mid-line", "unreadable"])
def test_a_suspicious_file_applies_only_once_stable_for_the_settle_period(data: bytes | None, effect: Effect,
                                                                          reason: str) -> None:
    assert decide(look(data, 10.0), look(data, 10.5), effect, settle_s=1.0) == Decision("wait", reason)
    assert decide(look(data, 10.0), look(data, 11.0), effect, settle_s=1.0) == Decision("apply", reason)


@pytest.mark.parametrize("data", [b"", b"\n \n\t\n", b"# appliance.yaml\n# nothing yet\n", b"---\n", b"---\n...\n",
                                  b"null\n", b"~\n", b"{}\n", b"--- {}  # empty\n"])
def test_a_file_with_no_settings_is_blank(data: bytes) -> None:
    assert blank(data)


@pytest.mark.parametrize("data", [FINISHED, b"models: []\n", b"admission_percent: 50\n", b"[]\n", b"a\n",
                                  b"'null'\n", b"models:\n  - [\n", b"\xff\xfe\n", b"--- {}\n--- {}\n"])
def test_a_file_with_a_value_or_a_syntax_error_is_not_blank(data: bytes) -> None:
    assert not blank(data)


def test_blank_stops_at_the_first_value_of_a_huge_file() -> None:
    huge = b"a: 1\n" + b"[" * 100_000
    started = time.perf_counter()
    assert not blank(huge)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("data", [b"", b"# only a comment\n", b"{}\n"])
def test_a_blank_file_is_refused_once_stable_and_never_applied(data: bytes) -> None:
    effect = Effect(valid=True, retired=("a",), every_model=True, moved=("the socket", "HTTP"))
    assert decide(look(data, 0.0), look(data, 0.2), effect, settle_s=1.0).action == "wait"
    refused = decide(look(data, 0.0), look(data, 1.0), effect, settle_s=1.0)
    assert refused.action == "refuse"
    assert "no settings" in refused.reason


# -- the reloader, with a fake applier and real writers ---------------------------------------------------------------
HEAD = "data_dir: {state}\ndevice: fake:8GiB\nhttp: {{port: 9100}}\n"
MODELS = "models:\n  - {name: a, path: /m/a.gguf}\n  - {name: b, path: /m/b.gguf}\n"


class FakeApplier:
    """Records every config it is asked to apply."""

    def __init__(self, path: Path) -> None:
        self.config = load_config(path, check_files=False)
        self.applied: list[ReloadPlan] = []
        self.models_applied: list[list[str]] = []

    async def apply(self, new, plan: ReloadPlan) -> str:  # type: ignore[no-untyped-def]
        self.applied.append(plan)
        self.models_applied.append([m.name for m in new.models])
        self.config = new
        return plan.summary()

    def ready_status(self) -> str:
        return f"{len(self.config.models)} model(s)"

    def replaced_files(self) -> tuple[str, ...]:
        return ()


def no_files(path: Path):  # type: ignore[no-untyped-def]
    return load_config(path, check_files=False)


def setup(tmp_path: Path) -> tuple[Path, FakeApplier, str]:
    path = tmp_path / "appliance.yaml"
    text = HEAD.format(state=tmp_path) + MODELS
    path.write_text(text)
    return path, FakeApplier(path), text


def save(path: Path, text: str) -> None:
    temporary = path.with_name(".appliance.yaml.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_slowly(path: Path, text: str, seconds: float) -> None:
    """Write ``text`` over ``path`` in place (truncate, then a byte at a time, flushed), over ``seconds``."""
    data = text.encode()
    with open(path, "wb") as fh:
        for index in range(len(data)):
            fh.write(data[index:index + 1])
            fh.flush()
            time.sleep(seconds / len(data))


async def watch_until(reloader: Reloader, done, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    """Run the reloader (its watchers too) until ``done()`` and no reload is pending, within ``timeout``."""
    runner = asyncio.create_task(reloader.run())
    deadline = time.monotonic() + timeout
    try:
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.wait_for(reloader.settled(), max(1.0, deadline - time.monotonic()))
    finally:
        reloader.stop.set()
        await runner


def test_a_slow_writer_in_place_is_applied_whole_and_never_half(tmp_path: Path) -> None:
    path, applier, text = setup(tmp_path)
    wanted = text.replace("fake:8GiB\n", "fake:8GiB\nadmission_percent: 40\n")

    async def main() -> Reloader:
        reloader = Reloader(path, applier, loader=no_files, poll_interval_s=0.5)
        writer = threading.Thread(target=write_slowly, args=(path, wanted, 2.0))
        await asyncio.sleep(0.3)  # the watchers took their first look
        writer.start()
        await watch_until(reloader, lambda: not writer.is_alive() and applier.config.admission_percent == 40)
        writer.join()
        return reloader

    reloader = asyncio.run(main())
    assert applier.config.admission_percent == 40
    assert applier.models_applied and all(names == ["a", "b"] for names in applier.models_applied), \
        applier.models_applied
    assert all(plan.retire_models == () and not plan.rebind_http for plan in applier.applied), applier.applied
    assert [r["result"] for r in reloader.history.to_list()].count("invalid") == 0, reloader.history.to_list()
    assert not reloader.degraded


def test_truncate_then_write_applies_only_the_written_file(tmp_path: Path) -> None:
    path, applier, text = setup(tmp_path)
    wanted = text + "agent_idle_ttl_s: 77\n"

    def truncate_then_write() -> None:
        with open(path, "wb") as fh:
            fh.flush()
            time.sleep(0.6)  # the watcher sees the empty file and asks for a reload
            fh.write(wanted.encode())

    async def main() -> Reloader:
        reloader = Reloader(path, applier, loader=no_files, poll_interval_s=0.5)
        writer = threading.Thread(target=truncate_then_write)
        await asyncio.sleep(0.3)
        writer.start()
        await watch_until(reloader, lambda: not writer.is_alive() and applier.config.agent_idle_ttl_s == 77)
        writer.join()
        return reloader

    reloader = asyncio.run(main())
    assert applier.config.agent_idle_ttl_s == 77
    assert all(names == ["a", "b"] for names in applier.models_applied), applier.models_applied
    assert applier.config.http.port == 9100
    assert not reloader.degraded


@pytest.mark.parametrize("trigger", ["file", "SIGHUP", "api", "tune", "benchmark"])
@pytest.mark.parametrize("content", ["", "\n\n", "# the new config is coming\n"], ids=["empty", "newlines", "comment"])
def test_an_empty_file_is_refused_and_degrades_until_a_valid_one(tmp_path: Path, trigger: str, content: str) -> None:
    path, applier, text = setup(tmp_path)
    before = applier.config

    async def main():  # type: ignore[no-untyped-def]
        reloader = Reloader(path, applier, loader=no_files, settle_s=0.1)
        save(path, content)
        refused = await reloader.reload(trigger)  # type: ignore[arg-type]
        problems = reloader.problems
        save(path, text + "admission_percent: 60\n")
        fixed = await reloader.reload(trigger)  # type: ignore[arg-type]
        return refused, problems, fixed, reloader.degraded

    refused, problems, fixed, still_degraded = asyncio.run(main())
    assert refused.result == "invalid"
    assert "no settings" in refused.problems[0]
    assert "no settings" in problems[0].message
    assert applier.applied == [ReloadPlan(live_settings=("admission_percent",))]  # nothing from the empty file
    assert fixed.result == "applied"
    assert not still_degraded
    assert before.http.port == applier.config.http.port == 9100


def test_models_emptied_on_purpose_apply_once_stable_with_a_warning(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    path, applier, _text = setup(tmp_path)
    save(path, HEAD.format(state=tmp_path) + "models: []\n")

    async def main():  # type: ignore[no-untyped-def]
        return await Reloader(path, applier, loader=no_files, settle_s=0.4).reload("SIGHUP")

    with caplog.at_level(logging.WARNING, logger="appliance.supervisor.reloader"):
        record = asyncio.run(main())
    assert record.result == "applied"
    assert record.duration_ms >= 400
    assert applier.models_applied == [[]]
    assert any("removes every model" in message for message in caplog.messages), caplog.messages


def test_a_clean_edit_does_not_wait_for_the_settle_period(tmp_path: Path) -> None:
    path, applier, text = setup(tmp_path)
    save(path, text + "  - {name: c, path: /m/c.gguf}\n")

    async def main():  # type: ignore[no-untyped-def]
        reloader = Reloader(path, applier, loader=no_files, settle_s=60, settle_deadline_s=120)
        return await asyncio.wait_for(reloader.reload("SIGHUP"), 20)

    record = asyncio.run(main())
    assert record.result == "applied"
    assert applier.models_applied == [["a", "b", "c"]]


def test_a_file_that_never_settles_is_refused_at_the_deadline_then_read_again(tmp_path: Path) -> None:
    path, applier, _text = setup(tmp_path)
    stop = threading.Event()
    writing = threading.Event()
    only_a = HEAD.format(state=tmp_path) + "models:\n  - {name: a, path: /m/a.gguf}\n"  # retires b: must settle

    def keep_writing() -> None:
        count = 0
        while not stop.is_set():
            count += 1
            save(path, only_a + f"agent_idle_ttl_s: {count}\n")
            writing.set()
            time.sleep(0.01)

    async def main():  # type: ignore[no-untyped-def]
        reloader = Reloader(path, applier, loader=no_files, settle_s=0.1, settle_deadline_s=0.8)
        writer = threading.Thread(target=keep_writing)
        writer.start()
        try:
            assert await asyncio.to_thread(writing.wait, 10)
            refused = await reloader.reload("file")
        finally:
            stop.set()
            writer.join()
        degraded = reloader.degraded
        later = await reloader.reload("file")
        return refused, degraded, later, reloader.degraded

    refused, degraded, later, still_degraded = asyncio.run(main())
    assert refused.result == "invalid"
    assert "still not settled after 0.8 s" in refused.problems[0]
    assert degraded
    assert later.result == "applied"
    assert applier.models_applied == [["a"]]
    assert not still_degraded


def test_a_stop_while_waiting_for_the_file_ends_the_reload_at_once(tmp_path: Path) -> None:
    path, applier, _text = setup(tmp_path)
    save(path, HEAD.format(state=tmp_path) + "models: []\n")

    async def main():  # type: ignore[no-untyped-def]
        reloader = Reloader(path, applier, loader=no_files, settle_s=30, settle_deadline_s=60)
        pending = asyncio.create_task(reloader.reload("SIGHUP"))
        await asyncio.sleep(0.3)
        reloader.stop.set()
        return await asyncio.wait_for(pending, 5)

    record = asyncio.run(main())
    assert record.result == "failed"
    assert "stopping" in record.error
    assert applier.applied == []

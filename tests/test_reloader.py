"""The reloader driven with a fake applier: validate, diff, plan, apply, record, serialize (SPEC C3)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from appliance.config.validate import load_config
from appliance.supervisor.notify import Notifier
from appliance.supervisor.plan import ReloadPlan
from appliance.supervisor.reloader import Reloader

TEXT = """\
data_dir: {state}
device: fake:8GiB
models:
  - {{name: a, path: /m/a.gguf}}
"""


class FakeApplier:
    def __init__(self, path: Path) -> None:
        self.config = load_config(path, check_files=False)
        self.applied: list[ReloadPlan] = []
        self.fail = False
        self.gate: asyncio.Event | None = None
        self.replaced: tuple[str, ...] = ()

    async def apply(self, new, plan: ReloadPlan) -> str:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the new listener could not bind")
        self.applied.append(plan)
        self.config = new
        return plan.summary()

    def ready_status(self) -> str:
        return f"{len(self.config.models)} model(s)"

    def replaced_files(self) -> tuple[str, ...]:
        return self.replaced



def no_files(path: Path):
    return load_config(path, check_files=False)


def save(path: Path, text: str) -> None:
    tmp = path.with_name(".appliance.yaml.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def setup(tmp_path: Path) -> tuple[Path, FakeApplier]:
    path = tmp_path / "appliance.yaml"
    path.write_text(TEXT.format(state=tmp_path))
    return path, FakeApplier(path)


def test_a_valid_edit_is_planned_and_applied(tmp_path):
    path, applier = setup(tmp_path)

    async def main():
        reloader = Reloader(path, applier, loader=no_files)
        save(path, TEXT.format(state=tmp_path) + "  - {name: b, path: /m/b.gguf}\nadmission_percent: 50\n")
        return await reloader.reload("SIGHUP"), reloader

    record, reloader = asyncio.run(main())
    assert record.result == "applied"
    assert record.trigger == "SIGHUP"
    assert applier.applied == [ReloadPlan(add_models=("b",), live_settings=("admission_percent",))]
    assert [m.name for m in applier.config.models] == ["a", "b"]
    assert reloader.history.last is record
    assert not reloader.degraded


def test_an_invalid_file_changes_nothing_until_it_is_fixed(tmp_path):
    path, applier = setup(tmp_path)
    before = applier.config

    async def main():
        reloader = Reloader(path, applier, loader=no_files)
        save(path, TEXT.format(state=tmp_path) + "admission_percent: 500\n")
        broken = await reloader.reload("file")
        degraded = reloader.degraded
        problems = reloader.problems
        save(path, TEXT.format(state=tmp_path) + "admission_percent: 50\n")
        fixed = await reloader.reload("file")
        return broken, degraded, problems, fixed, reloader.degraded

    broken, degraded, problems, fixed, still_degraded = asyncio.run(main())
    assert broken.result == "invalid"
    assert degraded
    assert problems[0].line == 5
    assert "admission_percent" in broken.problems[0]
    assert fixed.result == "applied"
    assert not still_degraded
    assert applier.config is not before
    assert applier.config.admission_percent == 50


def test_an_unchanged_file_is_a_no_op(tmp_path):
    path, applier = setup(tmp_path)
    record = asyncio.run(Reloader(path, applier, loader=no_files).reload("SIGHUP"))
    assert record.result == "unchanged"
    assert applier.applied == []


def test_a_failed_apply_is_recorded_with_its_reason(tmp_path):
    path, applier = setup(tmp_path)
    applier.fail = True
    save(path, TEXT.format(state=tmp_path) + "http: {port: 9999}\n")
    record = asyncio.run(Reloader(path, applier, loader=no_files).reload("file"))
    assert record.result == "failed"
    assert "could not bind" in record.error


def test_requests_during_a_reload_coalesce_and_reloads_never_overlap(tmp_path):
    path, applier = setup(tmp_path)

    async def main():
        reloader = Reloader(path, applier, loader=no_files, poll_interval_s=60)
        applier.gate = asyncio.Event()
        runner = asyncio.create_task(reloader.run())
        save(path, TEXT.format(state=tmp_path) + "admission_percent: 40\n")
        reloader.request("SIGHUP")
        await asyncio.sleep(0.1)  # the first reload is now held in apply()
        for _ in range(5):
            reloader.request("SIGHUP")
        save(path, TEXT.format(state=tmp_path) + "admission_percent: 30\n")
        applier.gate.set()
        await asyncio.wait_for(reloader.settled(), 10)
        reloader.stop.set()
        await runner
        return reloader

    reloader = asyncio.run(main())
    results = [(r["trigger"], r["result"]) for r in reloader.history.to_list()]
    assert results[0] == ("SIGHUP", "applied")
    assert len([r for r in results if r[1] == "applied"]) == 2  # the held one, then one for all the rest
    assert applier.config.admission_percent == 30


def test_an_atomic_save_is_reloaded_within_two_seconds_and_systemd_is_told(tmp_path):
    path, applier = setup(tmp_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(5)

    async def main():
        reloader = Reloader(path, applier, Notifier(str(tmp_path / "notify")), loader=no_files, poll_interval_s=60)
        runner = asyncio.create_task(reloader.run())
        await asyncio.sleep(0.3)
        loop = asyncio.get_running_loop()
        start = loop.time()
        save(path, TEXT.format(state=tmp_path) + "  - {name: b, path: /m/b.gguf}\n")
        while [m.name for m in applier.config.models] != ["a", "b"] and loop.time() - start < 5:
            await asyncio.sleep(0.02)
        took = loop.time() - start
        reloader.stop.set()
        await runner
        return took

    took = asyncio.run(main())
    assert took < 2.0
    messages = [listener.recv(4096).decode() for _ in range(2)]
    listener.close()
    assert messages[0].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert messages[1] == "READY=1\nSTATUS=2 model(s)"

"""The reload plan (SPEC C3) on a table of config pairs: pure, no daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config.diff import diff
from appliance.config.validate import parse_config
from appliance.supervisor.plan import ReloadPlan, plan
from appliance.supervisor.record import Reload, ReloadHistory

BASE = """
data_dir: /tmp/ap-plan
device: fake:8GiB
models:
  - {name: a, path: /m/a.gguf, n_ctx: 512}
  - {name: b, path: /m/b.gguf, n_ctx: 512, idle_ttl_s: 60}
"""


def config(text: str):
    return parse_config(text, base_dir=Path("/tmp"), check_files=False)


def edited(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new)


CASES = [
    ("nothing", BASE, ReloadPlan()),
    ("a model added", BASE + "  - {name: c, path: /m/c.gguf}\n", ReloadPlan(add_models=("c",))),
    ("a model removed", edited("  - {name: b, path: /m/b.gguf, n_ctx: 512, idle_ttl_s: 60}\n", ""),
     ReloadPlan(retire_models=("b",))),
    ("a model's file", edited("/m/a.gguf", "/m/a2.gguf"), ReloadPlan(reload_models=("a",))),
    ("a model's context", edited("name: a, path: /m/a.gguf, n_ctx: 512", "name: a, path: /m/a.gguf, n_ctx: 1024"),
     ReloadPlan(reload_models=("a",))),
    ("a model's TTL only", edited("idle_ttl_s: 60", "idle_ttl_s: 30"), ReloadPlan(live_models=("b",))),
    ("admission", BASE + "admission_percent: 50\n", ReloadPlan(live_settings=("admission_percent",))),
    ("log level and limits", BASE + "log_level: debug\nmax_connections: 4\n",
     ReloadPlan(live_settings=("max_connections", "log_level"))),
    ("socket path", BASE + "socket: {path: /tmp/ap-plan/b.sock}\n", ReloadPlan(rebind_socket=True)),
    ("socket timeouts only", BASE + "socket: {idle_timeout_s: 5}\n",
     ReloadPlan(live_settings=("socket.idle_timeout_s",))),
    ("http port", BASE + "http: {port: 9000}\n", ReloadPlan(rebind_http=True)),
    ("device", edited("fake:8GiB", "fake:4GiB"), ReloadPlan(restart_needed=("device",))),
    ("engine threads", BASE + "engine: {threads: 2}\n", ReloadPlan(live_settings=("engine.threads",))),
    ("engine knobs", BASE + "engine: {hot_pool_slack: 1.5}\n", ReloadPlan(live_settings=("engine.hot_pool_slack",))),
    ("socket mode", BASE + "socket: {mode: '0600'}\n", ReloadPlan(rebind_socket=True)),
    # paths spelled relative to the data_dir follow it: the default model_dirs and socket path move too
    ("data_dir and a model", edited("/tmp/ap-plan", "/tmp/ap-plan2") + "  - {name: c, path: /m/c.gguf}\n",
     ReloadPlan(add_models=("c",), live_settings=("model_dirs",), rebind_socket=True, restart_needed=("data_dir",))),
]


@pytest.mark.parametrize(("name", "new", "expected"), CASES, ids=[case[0] for case in CASES])
def test_plan_table(name, new, expected):
    assert plan(diff(config(BASE), config(new))) == expected


def test_a_replaced_model_file_is_reloaded_unless_its_model_is_removed_or_already_reloading():
    replaced = plan(diff(config(BASE), config(BASE)), ("a", "b"))
    assert replaced == ReloadPlan(replaced_files=("a", "b")) and not replaced.empty
    assert "reloading replaced files of a, b" in replaced.summary()
    moved = plan(diff(config(BASE), config(edited("/m/a.gguf", "/m/a2.gguf"))), ("a", "b"))
    assert moved.reload_models == ("a",) and moved.replaced_files == ("b",)
    removed = edited("  - {name: b, path: /m/b.gguf, n_ctx: 512, idle_ttl_s: 60}\n", "")
    assert plan(diff(config(BASE), config(removed)), ("b",)).replaced_files == ()


def test_plan_summary_says_what_waits_for_a_restart():
    result = plan(diff(config(BASE), config(edited("fake:8GiB", "fake:4GiB") + "admission_percent: 50\n")))
    assert result.summary() == "settings admission_percent; restart needed for device"
    assert ReloadPlan().summary() == "no changes"
    assert ReloadPlan().empty
    assert not result.empty


def test_reload_history_keeps_the_last_fifty_and_says_one_line_each():
    history = ReloadHistory()
    for index in range(60):
        history.add(Reload(float(index), "file", "applied", "added models: c", "added c", (), 12.0))
    assert len(history) == 50
    assert history.to_list()[0]["at"] == 10.0
    assert history.last is not None
    assert history.last.line() == "reload (file) applied in 12 ms: added models: c; applied: added c"
    invalid = Reload(0.0, "SIGHUP", "invalid", "", "", (), 3.0, problems=("appliance.yaml:4: models[0].n_ctx: bad",))
    assert invalid.line() == "reload (SIGHUP) invalid in 3 ms: appliance.yaml:4: models[0].n_ctx: bad"

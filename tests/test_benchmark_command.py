"""``appliance benchmark`` (issue #13, SPEC B1-B3): a real ``--quick`` run on the shipped config's tiny model, its
saved JSON, the printed table, ``--apply`` into a commented config that a running appliance reloads (the reload
record names the benchmark), and the pure parts (progress lines, the report, turns in flight, ``RELOAD``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.benchmark import progress, report, runner
from appliance.benchmark.servers import free_port
from appliance.benchmark.session import FIGURE_KEYS, TurnResult, max_in_flight
from appliance.client.lines import request as line_request
from appliance.config import tune
from appliance.errors import ApplianceError
from appliance.protocol import lines

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "appliance.yaml"


def shipped_config(folder: Path, port: int) -> Path:
    """The shipped, commented ``appliance.yaml`` with its state folder and port moved (every comment kept)."""
    text = SHIPPED.read_text()
    text = re.sub(r"^data_dir: \./data( *)", lambda m: f"data_dir: {folder / 'data'}{m.group(1)}", text, count=1,
                  flags=re.M)
    text = re.sub(r"^  port: 8080( *)", lambda m: f"  port: {port}{m.group(1)}", text, count=1, flags=re.M)
    assert str(folder / "data") in text and f"port: {port}" in text
    path = folder / "appliance.yaml"
    path.write_text(text)
    return path


def appliance_cli(*args: str, stdin: int | None = subprocess.DEVNULL, timeout: float = 600,
                  ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=REPO, capture_output=True, text=True,
                          stdin=stdin, timeout=timeout)


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ap-bc-"))  # short: the socket path must fit in 108 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def quick(folder: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """One real ``appliance benchmark --quick`` on the shipped config (its demo model written on the way)."""
    config = shipped_config(folder, free_port())
    out = folder / "result.json"
    done = appliance_cli("benchmark", "--config", str(config), "--quick", "--json", "--out", str(out),
                         "--progress", "lines")
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text()), config


@pytest.mark.slow
def test_a_quick_benchmark_saves_every_field_of_the_table_and_the_advice(quick: tuple[Any, dict[str, Any], Path],
                                                                         ) -> None:
    done, result, _ = quick
    assert json.loads(done.stdout) == result  # --json prints what was saved
    assert result["benchmark"] == runner.NAME and result["quick"] is True and result["complete"] is True
    assert result["headline"].startswith("HEADLINE: appliance benchmark (demo, 2 agents x 3 rounds)")
    for strategy in ("fixed", "adaptive"):
        figures = result["table"][strategy]
        assert set(figures) == set(FIGURE_KEYS)
        assert figures["ttft_avg_ms"] > 0 and figures["ttft_p99_ms"] >= figures["ttft_avg_ms"] * 0.99
        assert figures["tokens_per_s"] > 0 and figures["peak_memory_bytes"] > 10 * 2**20
        assert isinstance(figures["memory_growth_bytes"], int)
        assert [row["round"] for row in result["rounds"][strategy]] == [1, 2, 3]
        assert all(row["ttft_avg_ms"] > 0 and row["rss_bytes"] > 0 for row in result["rounds"][strategy])
    assert set(result["table"]["improvement"]) == set(FIGURE_KEYS)
    assert result["strategies"]["fixed"]["engine"]["adaptive"] is False
    assert [point["slack"] for point in result["slack_sweep"]] == list(runner.QUICK_SLACKS)
    assert all(point["peak_memory_bytes"] > 0 for point in result["slack_sweep"])
    assert [point["threads"] for point in result["thread_curve"]][0] == 1
    assert all(point["tokens_per_s"] > 0 for point in result["thread_curve"])
    assert result["concurrency"]["max_in_flight"] == 2  # two agents, every round at once
    assert [point["streams"] for point in result["concurrency_curve"]] == list(runner.QUICK_STREAMS)
    assert all(point["tokens_per_s"] > 0 for point in result["concurrency_curve"])
    [slots] = [entry for entry in result["advice"] if entry["key"] == "engine.live_slots"]
    assert slots["value"] in runner.QUICK_STREAMS and "streams decoded together" in slots["reason"]
    assert 0 <= result["cpu"]["others_share"] <= 1 and result["cpu"]["total_ticks"] > 0
    labels = [caveat["label"] for caveat in result["caveats"]]
    assert labels[:2] == ["quick", "single run"]  # a quick run of one repeat, whatever else the box did
    assert result["headline"].split("; CAVEATS: ")[1].startswith("quick, single run")
    assert result["device_class"]["name"] in ("low", "mid", "high") and result["device_class"]["reason"]
    keys = {entry["key"] for entry in result["advice"]}
    assert {"engine.adaptive_window_size", "engine.adaptive_sample_rate", "engine.hot_pool_slack",
            "engine.thread_idle_thresholds", "engine.live_slots", "engine.live_contexts"} <= keys
    instances = [entry for entry in result["advice"] if entry["key"] is None]
    assert {entry["model"] for entry in instances} == {"demo", "demo-wide"}  # every configured model
    assert all(entry["reason"] and "\n" not in entry["reason"] for entry in result["advice"])
    steps = [progress.parse_progress(line) for line in done.stderr.splitlines()]
    told = [step for step in steps if step is not None]
    assert told[0].done == 0 and told[-1].done == told[-1].total == len(told) - 1  # one line per step, in order


@pytest.mark.slow
def test_the_printed_report_has_the_table_the_measurements_and_each_advice_line(
        quick: tuple[Any, dict[str, Any], Path]) -> None:
    _, result, config = quick
    shown = appliance_cli("benchmark", "--config", str(config), "--result", str(config.parent / "result.json"))
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    for label in ("TTFT avg (ms)", "TTFT P99 (ms)", "tokens/s", "peak memory (MiB)", "memory growth (MiB)",
                  "hot_pool_slack sweep", "decode tokens/s by thread count",
                  "aggregate decode tokens/s by streams decoded together", "device class:",
                  "caveats (quick, single run"):
        assert label in out
    for entry in result["advice"]:
        assert entry["reason"] in out
    assert out.strip().splitlines()[-1] == result["headline"]


@pytest.fixture
def running_appliance(folder: Path, quick: tuple[Any, dict[str, Any], Path]) -> Iterator[Path]:
    """``appliance run`` on the benchmarked config, answering."""
    _, _, config = quick
    log = (folder / "run.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT)
    port = int(re.search(r"^  port: (\d+)", config.read_text(), flags=re.M).group(1))  # type: ignore[union-attr]
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (folder / "run.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the appliance did not answer"
        time.sleep(0.2)
    try:
        yield config
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def health(config: Path) -> dict[str, Any]:
    port = int(re.search(r"^  port: (\d+)", config.read_text(), flags=re.M).group(1))  # type: ignore[union-attr]
    document: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=10).json()
    return document


def comments(text: str) -> list[str]:
    """Every comment of a YAML text (whole-line and end-of-line), in order."""
    return [line[line.index("#"):] for line in text.splitlines() if "#" in line]


@pytest.mark.slow
def test_apply_writes_the_advice_keeping_every_comment_and_the_running_appliance_reloads_it(
        folder: Path, running_appliance: Path) -> None:
    config = running_appliance
    saved = json.loads((folder / "result.json").read_text())
    for entry in saved["advice"]:  # one change at least, whatever this box measured
        if entry["key"] == "engine.hot_pool_slack":
            entry["value"] = 1.35
    result_file = folder / "to-apply.json"
    result_file.write_text(json.dumps(saved))
    before = config.read_text()
    done = appliance_cli("benchmark", "--config", str(config), "--result", str(result_file), "--apply", "--yes")
    assert done.returncode == 0, done.stderr
    after = config.read_text()
    assert comments(after) == comments(before)  # every comment, in its place in the order
    assert len(after.splitlines()) == len(before.splitlines())  # no line added or lost (every key was present)
    changed = {entry["key"]: entry["value"] for entry in saved["advice"]
               if entry["key"] is not None and entry["value"] != entry["current"]}
    differing = [(old, new) for old, new in zip(before.splitlines(), after.splitlines(), strict=True) if old != new]
    assert len(differing) == len(changed)
    for old, new in differing:
        key = old.split(":")[0].strip()
        assert f"engine.{key}" in changed and new.split(":")[0] == old.split(":")[0]
    assert "--- a/appliance.yaml" in done.stderr and "+  hot_pool_slack: 1.35" in done.stderr
    assert "result=applied" in done.stderr and "trigger=benchmark" in done.stderr
    record = health(config)["config"]
    assert record["last_trigger"] == "benchmark" and record["last_reload"] == "applied"
    engine = health(config)["engine"]
    if "engine.live_slots" in changed:
        assert engine["live_slots"] == changed["engine.live_slots"]
    # applied again: nothing left to change, and the file is not rewritten
    again = appliance_cli("benchmark", "--config", str(config), "--result", str(result_file), "--apply", "--yes")
    assert again.returncode == 0 and "nothing to apply" in again.stderr
    assert config.read_text() == after


@pytest.mark.slow
def test_apply_asks_first_and_refuses_to_guess_without_a_terminal(folder: Path,
                                                                 quick: tuple[Any, dict[str, Any], Path]) -> None:
    _, result, config = quick
    copy = folder / "ask.yaml"
    copy.write_text(config.read_text())
    result["advice"] = [{**entry, "value": 1.4} if entry["key"] == "engine.hot_pool_slack" else entry
                        for entry in result["advice"]]
    (folder / "ask.json").write_text(json.dumps(result))
    done = appliance_cli("benchmark", "--config", str(copy), "--result", str(folder / "ask.json"), "--apply")
    assert done.returncode == 1
    assert "give --yes when stdin is not a terminal" in done.stderr
    assert "+  hot_pool_slack: 1.4" in done.stderr  # the diff is shown before the question
    assert "this advice rests on a run with caveats (quick, single run" in done.stderr  # and the caveats
    assert copy.read_text() == config.read_text()


def test_a_bad_model_or_a_foreign_result_is_a_one_line_error(tmp_path: Path) -> None:
    config = shipped_config(tmp_path, 18099)
    done = appliance_cli("benchmark", "--config", str(config), "--model", "nope", "--quick")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == ("appliance: no model named 'nope' in the config (configured: "
                                                     "demo, demo-wide)")
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"benchmark": "kv_swap"}))
    done = appliance_cli("benchmark", "--config", str(config), "--result", str(foreign))
    assert done.returncode == 2 and "is not a result of appliance benchmark" in done.stderr


# -- the pure parts ------------------------------------------------------------------------------------------------


def test_line_progress_tells_each_step_and_never_passes_the_total(tmp_path: Path) -> None:
    out = tmp_path / "progress.txt"
    with out.open("w") as stream:
        bar = progress.LineProgress(stream)
        bar.start(2)
        for label in ("a", "b", "c"):
            bar.advance(label)
    steps = [progress.parse_progress(line) for line in out.read_text().splitlines()]
    assert steps == [progress.Step(0, 2, "starting"), progress.Step(1, 2, "a"), progress.Step(2, 2, "b"),
                     progress.Step(2, 2, "c")]


def turn(sent: float, last: float | None) -> TurnResult:
    return TurnResult(0, 0, "u", 1, 1, sent=sent, last_token=last)


IN_FLIGHT = [
    ([], 0),
    ([turn(0, 1)], 1),
    ([turn(0, 2), turn(1, 3), turn(1.5, 4)], 3),
    ([turn(0, 1), turn(1, 2), turn(2, 3)], 1),  # one ends as the next begins: never two at once
    ([turn(0, 5), turn(1, 2), turn(3, 4)], 2),
    ([turn(0, None), turn(0, 1)], 1),  # a turn that never streamed was in flight for no time
]


@pytest.mark.parametrize(("turns", "most"), IN_FLIGHT)
def test_max_in_flight_counts_the_turns_streaming_at_once(turns: list[TurnResult], most: int) -> None:
    assert max_in_flight(turns) == most


def test_the_report_marks_kept_and_changed_settings_and_an_incomplete_run() -> None:
    figures = dict.fromkeys(FIGURE_KEYS, 1.0)
    result: dict[str, Any] = {
        "table": {"fixed": figures, "adaptive": {**figures, "ttft_avg_ms": None},
                  "improvement": {**dict.fromkeys(FIGURE_KEYS, 0.25), "ttft_avg_ms": None}},
        "model": {"name": "m"}, "workload": {"agents": 2, "rounds": 3},
        "device_class": {"name": "mid", "reason": "r"},
        "advice": [{"key": "engine.live_slots", "value": 2, "current": 4, "reason": "two at once"},
                   {"key": "engine.live_contexts", "value": "auto", "current": "auto", "reason": "all fit"},
                   {"key": None, "value": 3, "current": None, "reason": "model m: 3 instances", "model": "m"}],
        "complete": False, "errors": ["fixed: agent 0 round 1: boom"],
    }
    table = report.table_lines(result)
    assert table[1].split()[-3:] == ["1.0", "-", "-"]  # TTFT avg: adaptive not measured, no improvement
    assert table[3].split()[-1] == "+25%"
    lines_ = report.advice_lines(result)
    assert "  engine.live_slots: 4 -> 2: two at once" in lines_
    assert "  engine.live_contexts: keep auto: all fit" in lines_
    assert "  model m: 3 instances" in lines_
    headline = report.headline(result)
    assert headline.startswith("HEADLINE: ") and "1 setting(s) to change" in headline
    assert headline.endswith("INCOMPLETE: 1 failed turn(s)")


RELOAD_LINES = [
    ("RELOAD", lines.Command("RELOAD", trigger="api")),
    ("reload benchmark", lines.Command("RELOAD", trigger="benchmark")),
    ("RELOAD BENCHMARK\r\n", lines.Command("RELOAD", trigger="benchmark")),
]


@pytest.mark.parametrize(("line", "command"), RELOAD_LINES)
def test_reload_names_what_asked_for_it(line: str, command: lines.Command) -> None:
    assert lines.parse_line(line) == command


def test_reload_refuses_a_trigger_it_does_not_know() -> None:
    with pytest.raises(ApplianceError) as caught:
        lines.parse_line("RELOAD SIGHUP")
    assert caught.value.code == "BAD_REQUEST" and "usage: RELOAD [benchmark]" in caught.value.message


def test_reload_over_the_socket_runs_a_reload_now_with_its_trigger_in_the_record(tmp_path: Path) -> None:
    from tests.harness import running

    with running({}, model_dirs=[tmp_path], watch=True) as app:
        reply = lines.parse_reply(line_request(app.socket, "RELOAD benchmark", timeout=30))
        assert reply.error is None
        assert reply.fields["result"] == "unchanged" and reply.fields["trigger"] == "benchmark"
        app.edit(app.config_file.read_text().replace("resync_interval_s: 0", "resync_interval_s: 7"))
        reply = lines.parse_reply(line_request(app.socket, "RELOAD", timeout=30))
        assert reply.fields["result"] == "applied" and reply.fields["trigger"] == "api"
        assert "resync_interval_s" in reply.fields["diff"]
        assert [record["trigger"] for record in app.appliance.reload_history()][-2:] == ["benchmark", "api"]


def test_reload_over_the_socket_of_an_appliance_without_a_config_file_is_refused(tmp_path: Path) -> None:
    from tests.harness import running

    with running({}, model_dirs=[tmp_path]) as app:
        reply = line_request(app.socket, "RELOAD", timeout=30)
    assert reply.startswith("ERR FORBIDDEN") and "without a config file" in reply


# -- TUNE: engine settings held by a connection (what --socket measures with) -------------------------------------


TUNE_LINES = [
    ("TUNE", lines.Command("TUNE")),
    ("TUNE engine.adaptive=false engine.threads=1",
     lines.Command("TUNE", settings=(("engine.adaptive", "false"), ("engine.threads", "1")))),
    ("tune engine.thread_idle_thresholds=[70,20]",
     lines.Command("TUNE", settings=(("engine.thread_idle_thresholds", "[70,20]"),))),
]


@pytest.mark.parametrize(("line", "command"), TUNE_LINES)
def test_tune_reads_engine_settings(line: str, command: lines.Command) -> None:
    assert lines.parse_line(line) == command


BAD_TUNES = [
    ("TUNE log_level=debug", "engine settings only"),
    ("TUNE engine.nope=1", "engine settings only"),
    ("TUNE engine.threads", "usage: TUNE engine.threads=<value>"),
    ("TUNE engine.threads=", "usage: TUNE engine.threads=<value>"),
    ("TUNE engine.threads=1 engine.threads=2", "engine.threads given twice"),
]


@pytest.mark.parametrize(("line", "why"), BAD_TUNES)
def test_tune_refuses_what_is_not_one_engine_setting_each(line: str, why: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        lines.parse_line(line)
    assert caught.value.code == "BAD_REQUEST" and why in caught.value.message


TUNE_VALUES = [
    ({"engine.adaptive": "false"}, {"adaptive": False}),
    ({"engine.threads": "1", "engine.hot_pool_slack": "1.5"}, {"threads": 1, "hot_pool_slack": 1.5}),
    ({"engine.thread_idle_thresholds": "[70,20]"}, {"thread_idle_thresholds": (70, 20)}),
    ({"engine.live_contexts": "auto"}, {"live_contexts": None}),
]


@pytest.mark.parametrize(("settings", "values"), TUNE_VALUES)
def test_tune_values_are_the_configs_typed_values(settings: dict[str, str], values: dict[str, Any]) -> None:
    assert tune.engine_values(settings) == values


BAD_TUNE_VALUES = [
    ({"engine.threads": "-1"}, "engine.threads"),
    ({"engine.hot_pool_slack": "99"}, "engine.hot_pool_slack"),
    ({"engine.adaptive": "maybe"}, "engine.adaptive"),
    ({"engine.thread_idle_thresholds": "[10,20]"}, "engine.thread_idle_thresholds"),
    ({"engine.live_slots": "[1"}, "engine.live_slots"),
]


@pytest.mark.parametrize(("settings", "key"), BAD_TUNE_VALUES)
def test_tune_refuses_a_value_the_config_would_refuse(settings: dict[str, str], key: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        tune.engine_values(settings)
    assert caught.value.code == "BAD_REQUEST" and caught.value.message.startswith(key)


def test_later_tunings_win_and_none_leaves_the_config_alone(tmp_path: Path) -> None:
    from appliance.config.validate import default_config

    config = default_config(tmp_path)
    assert tune.merged([{"threads": 1, "adaptive": False}, {"threads": 2}]) == {"threads": 2, "adaptive": False}
    assert tune.tuned(config, {}) is config
    assert tune.tuned(config, {"threads": 3}).engine.threads == 3
    assert tune.tuned(config, {"threads": 3}).engine.adaptive == config.engine.adaptive


def context_of(app: Any, model: str) -> dict[str, Any]:
    [record] = [c for c in app.daemon.snapshot()["contexts"] if c["model"] == model]
    return record


def wait_for(predicate: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_tune_holds_settings_while_its_connection_lasts_and_lets_go_when_it_closes(tiny_model: Path) -> None:
    from appliance.benchmark.inplace import Control
    from tests.harness import running

    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True) as app:
        assert app.line("REGISTER a tiny").startswith("OK")
        # adaptive, the file's default: live_slots 4 start with the plan holding four 64-token prompts in one graph
        assert "plan=M threads=" in app.line("DECODE a 2 hello")
        for _ in range(3):
            app.line("DECODE a 2 and")
        app.settle()  # the retunes those requests asked for are done
        profile = app.daemon.profiles()["tiny"]
        pool = (context_of(app, "tiny")["pool_cells"], context_of(app, "tiny")["plan"])
        control = Control(app.socket)
        control.tune({"adaptive": False, "threads": 1})
        assert app.appliance.config_report()["tuned"] == {"engine.adaptive": False, "engine.threads": 1}
        wait_for(lambda: (context_of(app, "tiny")["plan"], context_of(app, "tiny")["threads"]) == ("fixed", 1),
                 "the context is rebuilt with the fixed strategy and one thread")
        assert "plan=fixed threads=1" in app.line("DECODE a 2")
        for _ in range(3):
            app.line("DECODE a 2 more")
        assert app.daemon.profiles()["tiny"] != profile  # the held settings' load is profiled meanwhile
        # a file reload meanwhile keeps what the connection holds
        app.edit(app.config_file.read_text().replace("resync_interval_s: 0", "resync_interval_s: 9"))
        assert app.reload().result == "applied"
        assert app.daemon.config.engine.threads == 1 and app.daemon.config.resync_interval_s == 9
        reply = lines.parse_reply(line_request(app.socket, "TUNE engine.adaptive=maybe", timeout=30))
        assert reply.error is not None and reply.error.code == "BAD_REQUEST"  # and the held settings stay
        assert app.daemon.config.engine.adaptive is False
        control.close()
        wait_for(lambda: "tuned" not in app.appliance.config_report(), "the settings are let go")
        wait_for(lambda: context_of(app, "tiny")["plan"] != "fixed", "the context goes adaptive again")
        wait_for(lambda: app.daemon.profiles()["tiny"] == profile, "the profile is back as it was")
        wait_for(lambda: (context_of(app, "tiny")["pool_cells"], context_of(app, "tiny")["plan"]) == pool,
                 "the context is back to its own profile's pool and plan")
        assert app.daemon.config.engine.threads == 0 and app.daemon.config.resync_interval_s == 9
        triggers = [record["trigger"] for record in app.appliance.reload_history()]
        assert triggers[-1] == "tune" and triggers.count("tune") == 2


def test_a_reload_applies_engine_threads_to_the_live_context(tiny_model: Path) -> None:
    from tests.harness import running

    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], watch=True) as app:
        assert app.line("REGISTER a tiny").startswith("OK")
        app.line("DECODE a 2 hello")
        app.edit(app.config_file.read_text() + "engine:\n  threads: 1\n")
        record = app.reload()
        assert record.result == "applied" and "engine.threads" in record.diff and not record.restart_needed
        assert "threads=1" in app.line("DECODE a 2")


@pytest.mark.slow
def test_a_benchmark_in_place_measures_the_running_appliance_and_leaves_it_as_it_found_it(
        folder: Path, running_appliance: Path) -> None:
    config = running_appliance
    port = int(re.search(r"^  port: (\d+)", config.read_text(), flags=re.M).group(1))  # type: ignore[union-attr]
    for words in (8, 64, 8):  # the model's context exists and has a profile of its own
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "demo", "prompt": "word " * words, "max_tokens": 4})
        assert reply.status_code == 200, reply.text
    before = health(config)
    assert before["contexts"]
    out = folder / "inplace.json"
    done = appliance_cli("benchmark", "--config", str(config), "--socket", "--quick", "--out", str(out),
                         "--progress", "none")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] and result["place"].startswith("in place: ")
    assert result["table"]["fixed"]["peak_memory_bytes"] > 10 * 2**20
    assert all(result["table"][strategy]["ttft_avg_ms"] > 0 for strategy in ("fixed", "adaptive"))
    assert all(row["plan"] == "fixed" for row in result["rounds"]["fixed"])
    assert all(row["plan"] != "fixed" for row in result["rounds"]["adaptive"])
    wait_for(lambda: "tuned" not in health(config)["config"], "the run's settings are let go")
    after = health(config)
    assert after["agents"] == before["agents"]  # its conversations are gone
    assert after["engine"]["adaptive"] == before["engine"]["adaptive"]
    assert after["config"]["sha256"] == before["config"]["sha256"]  # the file is untouched

    def contexts() -> list[tuple[str, int, str]]:
        return [(c["model"], c["pool_cells"], c["plan"]) for c in health(config)["contexts"]]

    wanted = [(c["model"], c["pool_cells"], c["plan"]) for c in before["contexts"]]
    wait_for(lambda: contexts() == wanted, f"the contexts are back as they were: {wanted}")


def test_repetitions_report_each_figures_median_and_none_when_one_failed() -> None:
    runs = [dict.fromkeys(FIGURE_KEYS, 1.0), dict.fromkeys(FIGURE_KEYS, 3.0), dict.fromkeys(FIGURE_KEYS, 2.0)]
    runs[0]["peak_memory_bytes"], runs[1]["peak_memory_bytes"], runs[2]["peak_memory_bytes"] = 100, 300, 201
    medians = runner.median_figures(runs)
    assert medians["ttft_avg_ms"] == 2.0 and medians["peak_memory_bytes"] == 201
    assert runner.median_figures(runs[:2])["peak_memory_bytes"] == 200  # an even count: the mean of the middle two
    runs[1]["tokens_per_s"] = None
    assert runner.median_figures(runs)["tokens_per_s"] is None


def test_a_runs_steps_count_every_round_of_every_repetition_and_each_thread_count(tmp_path: Path) -> None:
    once = runner.scale_of(runner.Options(tmp_path / "a.yaml", quick=True), cores=2)
    twice = runner.scale_of(runner.Options(tmp_path / "a.yaml", quick=True, repeats=2), cores=2)
    assert once.steps == 2 * 3 + 3 * 3 + 2 + 3
    assert twice.steps == 2 * (2 * 3 + 3 * 3) + 2 + 3
    full = runner.scale_of(runner.Options(tmp_path / "a.yaml"), cores=16)
    assert (full.agents, full.rounds, full.sweep_rounds) == (4, 20, 10) and full.thread_counts == tuple(range(1, 9))
    assert once.stream_counts == (1, 2, 4) and full.stream_counts == (1, 2, 4, 8, 16)


@pytest.mark.parametrize(
    ("streams", "expected"),
    [
        ([runner.StreamTiming(0.0, 1.0, 11), runner.StreamTiming(0.5, 2.0, 21)], 30 / 2.0),
        ([runner.StreamTiming(1.0, 2.0, 5)], 4.0),
        ([runner.StreamTiming(0.0, 1.0, 11), runner.StreamTiming(None, None, 0)], None),  # one produced nothing
        ([runner.StreamTiming(0.0, 1.0, 1)], None),  # one token: no decode speed
        ([], None),
    ],
    ids=["two-streams", "one-stream", "a-stream-failed", "one-token", "none"],
)
def test_the_aggregate_rate_counts_every_streams_tokens_over_the_whole_span(
        streams: list[runner.StreamTiming], expected: float | None) -> None:
    assert runner.aggregate_tokens_per_s(streams) == expected

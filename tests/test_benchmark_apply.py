"""``appliance benchmark --apply`` (issue #13): the advised keys are written into a copy of the repository's own,
heavily commented ``appliance.yaml`` and nothing else in it changes; a bad change is refused; the write is
atomic."""

from __future__ import annotations

import dataclasses
import errno
import io
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from appliance.benchmark import advice
from appliance.benchmark import apply as apply_module
from appliance.benchmark.apply import AdviceRejected, advised_text, apply_changes, unified_diff, write_atomic
from appliance.config import filewrite, roundtrip
from appliance.config.validate import load_config, parse_config

REPOSITORY_CONFIG = Path(__file__).resolve().parents[1] / "appliance.yaml"

ADVISED: dict[str, Any] = {
    "engine.hot_pool_slack": 1.05,
    "engine.thread_idle_thresholds": [100, 38],
    "engine.adaptive_window_size": 32,
    "engine.adaptive_sample_rate": 8,
    "engine.live_slots": 2,
    "engine.live_contexts": 1,
}


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "appliance.yaml"
    path.write_text(REPOSITORY_CONFIG.read_text(encoding="utf-8"), encoding="utf-8")
    return path


def comments(text: str) -> list[str]:
    """Every comment of ``text`` (whole-line and end-of-line), without the spaces before it."""
    return [line[line.index("#"):] for line in text.splitlines() if "#" in line]


def changed_lines(diff: str) -> tuple[list[str], list[str]]:
    """(removed, added) lines of a unified diff, headers left out."""
    removed = [line[1:] for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return removed, added


def key_name(line: str) -> str:
    return line.split(":", 1)[0].strip()


def engine_values(path: Path) -> dict[str, Any]:
    engine = load_config(path, check_files=False).engine
    return {f"engine.{name}": getattr(engine, name) for name in
            ("hot_pool_slack", "thread_idle_thresholds", "adaptive_window_size", "adaptive_sample_rate",
             "live_slots", "live_contexts")}


def test_the_repository_config_is_heavily_commented() -> None:
    """The premise of these tests: the file they edit has comments to lose."""
    assert len(comments(REPOSITORY_CONFIG.read_text(encoding="utf-8"))) > 40


def test_apply_writes_the_advised_keys_and_keeps_every_comment(config_file: Path) -> None:
    original = config_file.read_text(encoding="utf-8")
    applied = apply_changes(config_file, ADVISED)

    new_text = config_file.read_text(encoding="utf-8")
    assert new_text == applied.new_text
    assert applied.old_text == original
    assert set(applied.keys) == set(ADVISED)
    for comment in comments(original):
        assert comment in comments(new_text)
    assert len(comments(new_text)) == len(comments(original))
    assert new_text.count("\n\n") == original.count("\n\n")  # every blank line stays

    removed, added = changed_lines(applied.diff)
    names = {key.removeprefix("engine.") for key in ADVISED}
    assert sorted(map(key_name, removed)) == sorted(names)
    assert sorted(map(key_name, added)) == sorted(names)
    for line in added:
        assert "#" in line  # each changed key keeps its end-of-line comment
    assert any(line.startswith("  thread_idle_thresholds: [100, 38] ") for line in new_text.splitlines())

    values = engine_values(config_file)
    assert values == {**ADVISED, "engine.thread_idle_thresholds": (100, 38)}


def test_apply_keeps_the_key_order_and_the_flow_list(config_file: Path) -> None:
    original = config_file.read_text(encoding="utf-8")
    applied = apply_changes(config_file, {"engine.thread_idle_thresholds": (90, 45)})
    assert [key_name(line) for line in original.splitlines()] == [key_name(line) for line in
                                                                  applied.new_text.splitlines()]
    [line] = [line for line in applied.new_text.splitlines() if line.lstrip().startswith("thread_idle_thresholds")]
    assert line.startswith("  thread_idle_thresholds: [90, 45]")
    assert line.endswith("# CPU idle % above the first -> 4 threads, between -> 3, below the second -> 2")


def test_the_diff_names_the_file_and_only_the_changed_keys(config_file: Path) -> None:
    applied = apply_changes(config_file, {"engine.live_slots": 6})
    lines = applied.diff.splitlines()
    assert lines[0] == "--- a/appliance.yaml"
    assert lines[1] == "+++ b/appliance.yaml"
    removed, added = changed_lines(applied.diff)
    assert [line.split("#")[0].strip() for line in removed] == ["live_slots: 4"]
    assert [line.split("#")[0].strip() for line in added] == ["live_slots: 6"]
    assert applied.diff == unified_diff(applied.old_text, applied.new_text, config_file)


def test_a_key_missing_from_the_file_is_added_at_the_end_of_its_section(config_file: Path) -> None:
    text = "\n".join(line for line in config_file.read_text(encoding="utf-8").splitlines()
                     if not line.lstrip().startswith(("live_slots:", "thread_idle_thresholds:"))) + "\n"
    config_file.write_text(text, encoding="utf-8")

    applied = apply_changes(config_file, {"engine.live_slots": 3, "engine.thread_idle_thresholds": [80, 40]})

    removed, added = changed_lines(applied.diff)
    assert removed == []
    assert added == ["  live_slots: 3", "  thread_idle_thresholds: [80, 40]"]
    lines = applied.new_text.splitlines()
    models = lines.index("models:                           # each model is served under its name")
    assert lines[models - 1] == ""  # the blank line still separates the sections
    assert lines[models - 2] == "  thread_idle_thresholds: [80, 40]"
    assert lines[models - 3] == "  live_slots: 3"
    assert lines[models - 4].startswith("  threads: 0 ")
    values = engine_values(config_file)
    assert values["engine.live_slots"] == 3
    assert values["engine.thread_idle_thresholds"] == (80, 40)


def test_a_missing_section_is_created_at_the_end_of_the_file(config_file: Path) -> None:
    text = config_file.read_text(encoding="utf-8")
    without_engine = text[: text.index("engine:\n")] + text[text.index("models:"):]
    config_file.write_text(without_engine, encoding="utf-8")

    applied = apply_changes(config_file, {"engine.live_slots": 3, "engine.hot_pool_slack": 1.5})

    assert applied.new_text.startswith(without_engine)
    assert applied.new_text[len(without_engine):] == "\nengine:\n  live_slots: 3\n  hot_pool_slack: 1.5\n"
    values = engine_values(config_file)
    assert values["engine.live_slots"] == 3
    assert values["engine.hot_pool_slack"] == 1.5


@pytest.mark.parametrize(
    ("text", "changes", "expected"),
    [
        ("", {"engine.live_slots": 2}, "engine:\n  live_slots: 2\n"),
        ("# nothing set yet\n", {"engine.live_slots": 2}, "# nothing set yet\nengine:\n  live_slots: 2\n"),
        ("engine: {threads: 1}\n", {"engine.live_slots": 2}, "engine: {threads: 1, live_slots: 2}\n"),
        ("engine:\n  threads: 1", {"engine.live_slots": 2}, "engine:\n  threads: 1\n  live_slots: 2"),
        ("engine:\n    live_slots: 4   # four\n", {"engine.live_slots": 16}, "engine:\n    live_slots: 16  # four\n"),
        ("engine:\n  plan_boundaries:\n  - 1\n  - 2\n", {"engine.plan_boundaries": [3, 4]},
         "engine:\n  plan_boundaries:\n  - 3\n  - 4\n"),
        ("engine:\n  live_contexts: 'auto'\n", {"engine.live_contexts": "auto"}, "engine:\n  live_contexts: 'auto'\n"),
        ("socket:\n  group: ~\nengine:\n  live_slots: 1\n", {"engine.live_slots": 2},
         "socket:\n  group: ~\nengine:\n  live_slots: 2\n"),
        ("max_connections: 128  # all\n", {"max_connections": 64}, "max_connections: 64   # all\n"),
    ],
    ids=["empty-file", "comment-only", "flow-section", "no-final-newline", "four-space-indent", "block-list",
         "same-value-untouched", "tilde-null-kept", "top-level-key"],
)
def test_advised_text(text: str, changes: dict[str, Any], expected: str) -> None:
    assert advised_text(text, changes) == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine.live_slots": 0}, "engine.live_slots: 0 would make .* invalid"),
        ({"engine.thread_idle_thresholds": [30, 60]}, "engine.thread_idle_thresholds: \\[30, 60\\] would make"),
        ({"engine.hot_pool_slack": 20.0}, "engine.hot_pool_slack: 20.0 would make"),
        ({"engine.live_contexts": "some"}, "engine.live_contexts: 'some' would make"),
        ({"engine.no_such_key": 1}, "'engine.no_such_key': not a config key"),
        ({"models[].n_ctx": 512}, "models\\[\\].n_ctx: a per-model key"),
        ({"engine.live_slots": {"a": 1}}, "engine.live_slots: .* not a YAML scalar"),
    ],
    ids=["slots-zero", "thresholds-reversed", "slack-too-large", "contexts-word", "unknown-key", "model-key",
         "mapping-value"],
)
def test_an_invalid_change_is_refused_and_the_file_is_unchanged(
    config_file: Path, changes: dict[str, Any], message: str
) -> None:
    before = config_file.read_bytes()
    with pytest.raises(AdviceRejected, match=message):
        apply_changes(config_file, changes)
    assert config_file.read_bytes() == before
    assert sorted(path.name for path in config_file.parent.iterdir()) == ["appliance.yaml"]


def test_a_file_that_cannot_be_kept_exactly_is_refused(config_file: Path) -> None:
    config_file.write_text("engine:\n  live_slots:     4\n", encoding="utf-8")
    with pytest.raises(AdviceRejected, match="line 2: 'live_slots:     4' would change"):
        apply_changes(config_file, {"engine.live_slots": 2})
    assert config_file.read_text(encoding="utf-8") == "engine:\n  live_slots:     4\n"


def test_an_invalid_file_is_refused_before_any_change(config_file: Path) -> None:
    config_file.write_text("engine:\n  live_slots: 0\n", encoding="utf-8")
    with pytest.raises(AdviceRejected, match="not a valid config before any change"):
        apply_changes(config_file, {"engine.hot_pool_slack": 1.5})


def test_nothing_to_change_writes_nothing(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_write(path: Path, text: str) -> None:
        raise AssertionError("nothing should be written")

    monkeypatch.setattr(apply_module, "write_atomic", no_write)
    applied = apply_changes(config_file, {"engine.live_slots": 4, "engine.thread_idle_thresholds": (60, 30)})
    assert applied.diff == ""
    assert applied.keys == ()
    assert applied.new_text == applied.old_text


def test_the_result_resolves_paths_against_the_file(config_file: Path) -> None:
    applied = apply_changes(config_file, {"engine.live_slots": 2})
    config = parse_config(applied.new_text, source=config_file, check_files=False)
    assert config.data_dir == config_file.parent / "data"


# --- the atomic write ------------------------------------------------------------------------------------------------


def test_write_atomic_keeps_the_mode_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("old\n", encoding="utf-8")
    path.chmod(0o640)
    write_atomic(path, "new\n")
    assert path.read_text(encoding="utf-8") == "new\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [entry.name for entry in tmp_path.iterdir()] == ["appliance.yaml"]


def test_write_atomic_through_a_symlink_edits_its_target(tmp_path: Path) -> None:
    target = tmp_path / "real.yaml"
    target.write_text("old\n", encoding="utf-8")
    link = tmp_path / "appliance.yaml"
    link.symlink_to(target)
    write_atomic(link, "new\n")
    assert link.is_symlink()
    assert target.read_text(encoding="utf-8") == "new\n"


def test_a_failing_rename_leaves_the_original_and_no_temporary_file(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = config_file.read_bytes()

    def failing_replace(source: Any, destination: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        apply_changes(config_file, ADVISED)
    assert config_file.read_bytes() == before
    assert [entry.name for entry in config_file.parent.iterdir()] == ["appliance.yaml"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_leaves_the_original(config_file: Path) -> None:
    before = config_file.read_bytes()
    folder = config_file.parent
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError):
            apply_changes(config_file, ADVISED)
    finally:
        folder.chmod(0o755)
    assert config_file.read_bytes() == before
    assert [entry.name for entry in folder.iterdir()] == ["appliance.yaml"]


def test_a_failing_write_leaves_the_original_and_no_temporary_file(
    config_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = config_file.read_bytes()

    def failing_fsync(descriptor: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        apply_changes(config_file, ADVISED)
    assert config_file.read_bytes() == before
    assert [entry.name for entry in config_file.parent.iterdir()] == ["appliance.yaml"]


def test_editing_leaves_ruamel_defaults_alone_for_other_users() -> None:
    """The null spellings tried on a file use representers of their own, not ruamel's shared class."""
    advised_text("socket:\n  group: ~\n", {"engine.live_slots": 2})
    stream = io.StringIO()
    YAML().dump({"group": None}, stream)
    assert stream.getvalue() == "group:\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another owner")
def test_write_atomic_as_root_keeps_the_owner(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("old\n", encoding="utf-8")
    os.chown(path, 1234, 5678)
    write_atomic(path, "new\n")
    assert (path.stat().st_uid, path.stat().st_gid) == (1234, 5678)


def test_the_advice_of_a_recorded_session_applies_to_the_repository_config(config_file: Path) -> None:
    """advise -> changes -> apply on the real file: every keyed recommendation ends up in the config as advised."""
    config = load_config(config_file, check_files=False)
    measurements = advice.Measurements(
        machine=advice.Machine(2, 8 * advice.GIB, "host", 8 * advice.GIB),
        tokens_per_s=17.0,
        slack_sweep=(advice.SlackPoint(1.0, 250.0, 260.0, 100 * advice.MIB, 17.0),
                     advice.SlackPoint(1.5, 205.0, 240.0, 140 * advice.MIB, 17.5)),
        thread_curve=(advice.ThreadPoint(1, 12.0), advice.ThreadPoint(2, 9.0)),
        concurrency_curve=(advice.ConcurrencyPoint(1, 12.0), advice.ConcurrencyPoint(2, 21.0),
                           advice.ConcurrencyPoint(4, 21.5)),
        models=(advice.ModelFootprint("demo", 20 * advice.MIB, 32 * advice.MIB),),
        max_connections=config.max_connections,
        current=advice.current_settings(config),
    )
    _, recommendations = advice.advise(measurements)
    wanted = advice.changes(recommendations)
    assert wanted  # a low box: the window, sample rate, slack, thresholds, the thread pin and slots all move
    assert wanted["engine.threads"] == 1 and wanted["engine.live_slots"] == 2

    applied = apply_changes(config_file, wanted)

    assert set(applied.keys) == set(wanted)
    after = advice.current_settings(load_config(config_file, check_files=False))
    for recommendation in recommendations:
        if recommendation.key is not None:
            assert after[recommendation.key] == recommendation.value
    assert advice.changes(
        [dataclasses.replace(recommendation, current=after.get(recommendation.key))
         for recommendation in recommendations]) == {}


# --- what a result file may apply (issue: apply wrote any non-model key of a crafted result) --------------------------


def entry(key: str | None, value: Any, current: Any = None) -> dict[str, Any]:
    return {"key": key, "value": value, "current": current, "reason": "measured"}


@pytest.mark.parametrize(
    ("key", "value"),
    [("http.host", "0.0.0.0"), ("http.api_token", "stolen"), ("model_dirs", ["/"]), ("max_connections", 65536),
     ("engine.flash_attention", True), ("engine.plan_boundaries", [1, 2])],
)
def test_a_result_advising_a_key_outside_the_advice_is_refused_naming_it(
    config_file: Path, key: str, value: Any
) -> None:
    before = config_file.read_bytes()
    advice_entries = [entry("engine.live_slots", 2, 4), entry(key, value)]
    with pytest.raises(apply_module.AdviceRefused, match=f"advice entry 2: {re.escape(key)}: not a key the advice "
                                                         f"sets") as refused:
        apply_module.pending_changes(config_file, advice_entries)
    assert refused.value.key == key
    assert config_file.read_bytes() == before


def test_a_key_outside_the_advice_is_refused_even_when_it_would_change_nothing(config_file: Path) -> None:
    """The result is crafted either way: nothing of it is applied."""
    current_connections = load_config(config_file, check_files=False).max_connections
    with pytest.raises(apply_module.AdviceRefused, match="max_connections: not a key the advice sets"):
        apply_module.pending_changes(config_file, [entry("max_connections", current_connections)])


@pytest.mark.parametrize(
    ("key", "value", "refused"),
    [("http.host", "0.0.0.0", "http.host: not a key the advice sets"),
     ("engine.adaptive_window_size", 1000, "engine.adaptive_window_size: 1000 is not a value the advice gives "
                                           "\\(one of 32, 64, 128"),
     ("engine.adaptive_sample_rate", 3, "engine.adaptive_sample_rate: 3 is not a value the advice gives"),
     ("engine.adaptive_window_size", 64.0, "engine.adaptive_window_size: 64.0 is not a value"),
     ("engine.live_contexts", 3, "engine.live_contexts: 3 is not a value the advice gives \\(auto or an integer "
                                 "from 1 to 2, the configured models"),
     ("engine.threads", 2, "engine.threads: 2 is not a value the advice gives \\(an integer from 0 to 1\\)")],
)
def test_the_writer_refuses_what_the_advice_could_not_have_produced(
    config_file: Path, key: str, value: Any, refused: str
) -> None:
    """apply_changes itself writes only the advised keys, each with a value of its own range (the config would take
    every one of these; the repository config has two models)."""
    assert len(load_config(config_file, check_files=False).models) == 2
    before = config_file.read_bytes()
    with pytest.raises(apply_module.AdviceRefused, match=refused):
        apply_changes(config_file, {key: value})
    assert config_file.read_bytes() == before
    assert sorted(path.name for path in config_file.parent.iterdir()) == ["appliance.yaml"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("engine.adaptive_window_size", 128), ("engine.adaptive_sample_rate", 2), ("engine.hot_pool_slack", 10),
     ("engine.hot_pool_slack", 1.0), ("engine.thread_idle_thresholds", (1, 0)),
     ("engine.thread_idle_thresholds", [100, 99]), ("engine.live_slots", 64), ("engine.live_contexts", "auto"),
     ("engine.threads", 1), ("engine.threads", 0)],
)
def test_the_edges_of_each_advised_range_are_written(config_file: Path, key: str, value: Any) -> None:
    applied = apply_changes(config_file, {key: value})
    assert advice.current_settings(load_config(config_file, check_files=False))[key] == advice.file_value(value)
    assert applied.keys == ((key,) if applied.diff else ())


@pytest.mark.parametrize("cores", [1, 2, 3, 5, 8, 64, 267, 400])
@pytest.mark.parametrize("streams", [1, 2, 7, 200])
@pytest.mark.parametrize("device_mib", [1, 60, 100, 10_000])
def test_whatever_the_advice_recommends_passes_its_own_allow_list(cores: int, streams: int,
                                                                  device_mib: int) -> None:
    """The gate refuses nothing the advice itself gives, on small and huge boxes (every key, its edges)."""
    models = (advice.ModelFootprint("a", 20 * advice.MIB, 30 * advice.MIB),
              advice.ModelFootprint("b", 40 * advice.MIB, 10 * advice.MIB))
    measurements = advice.Measurements(
        machine=advice.Machine(cores, cores * advice.GIB, "host", device_mib * advice.MIB),
        tokens_per_s=5.0 * cores,
        slack_sweep=(advice.SlackPoint(1.0, 250.0, 260.0, 100 * advice.MIB, 17.0),
                     advice.SlackPoint(10.0, 200.0, 240.0, 90 * advice.MIB, 17.5)),
        thread_curve=(advice.ThreadPoint(1, 12.0), advice.ThreadPoint(2, 9.0 if cores % 2 else 14.0),
                      advice.ThreadPoint(3, 8.0)),
        concurrency_curve=(advice.ConcurrencyPoint(1, 10.0), advice.ConcurrencyPoint(streams + 1, 30.0)),
        models=models,
        max_connections=64,
        current={"engine.threads": 1},  # one thread pinned: the curve advises keeping it or 0
    )
    _, recommendations = advice.advise(measurements)
    keyed = [recommendation for recommendation in recommendations if recommendation.key is not None]
    assert {recommendation.key for recommendation in keyed} == set(advice.ADVISED)
    for recommendation in keyed:
        value = recommendation.to_dict()["value"]  # as the result file holds it
        assert advice.refusal(recommendation.key, value, len(models)) is None, (recommendation.key, value)


# --- comments are the operator's data ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "changes", "expected"),
    [
        ("engine:\n  thread_idle_thresholds:\n  - 60   # high\n  - 30   # low\n",
         {"engine.thread_idle_thresholds": [100, 38]},
         "engine:\n  thread_idle_thresholds:\n  - 100  # high\n  - 38   # low\n"),
        ("engine:\n", {"engine.live_slots": 2}, "engine:\n  live_slots: 2\n"),
        ("max_connections: 3\nengine:\n\nmodels: []\n", {"engine.live_slots": 2},
         "max_connections: 3\nengine:\n  live_slots: 2\n\nmodels: []\n"),
        ("engine:   # tuned below\nmodels: []\n", {"engine.live_slots": 2},
         "engine:   # tuned below\n  live_slots: 2\nmodels: []\n"),
        ("max_connections: 3\nengine: ~   # later\n\n# the models\nmodels: []\n", {"engine.live_slots": 2},
         "max_connections: 3\nengine:     # later\n  live_slots: 2\n\n# the models\nmodels: []\n"),
    ],
    ids=["block-list-item-comments", "empty-first-section", "empty-middle-section", "empty-section-comment",
         "null-section-then-a-comment"],
)
def test_comments_and_blank_lines_stay_where_they_are(text: str, changes: dict[str, Any], expected: str) -> None:
    assert advised_text(text, changes) == expected
    assert comments(advised_text(text, changes)) == comments(text)


def test_an_edit_that_would_drop_a_comment_is_refused() -> None:
    """The last guard: whatever the round trip does, a comment of the file never silently goes."""
    old = "engine:\n  live_slots: 4  # four\n  threads: 0  # auto\n"
    with pytest.raises(AdviceRejected, match="would drop the comment '# auto' \\(line 3\\)"):
        roundtrip.check_comments_kept(old, "engine:\n  live_slots: 2  # four\n  threads: 0\n", "the config")
    roundtrip.check_comments_kept(old, "engine:\n  live_slots: 2    # four\n  threads: 0  # auto\n", "the config")


# --- the write: temporary files, hard links, read-only files --------------------------------------------------------


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporary_files_left_by_a_killed_apply_are_removed_by_the_next(config_file: Path) -> None:
    folder = config_file.parent
    gone = dead_pid()
    stale = [folder / ".appliance.yaml.k3j_9x0a.tmp", folder / f".appliance.yaml.{gone}.ab12cd34.tmp"]
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            kept = [folder / f".appliance.yaml.{alive.pid}.zz99yy88.tmp",  # its writer still runs
                    folder / ".appliance.yaml.swp", folder / ".other.yaml.k3j_9x0a.tmp", folder / "notes.tmp"]
            for path in [*stale, *kept]:
                path.write_text("half written")
            apply_changes(config_file, {"engine.live_slots": 2})
            assert sorted(path.name for path in folder.iterdir()) == sorted(["appliance.yaml",
                                                                             *(path.name for path in kept)])
        finally:
            alive.kill()
    assert load_config(config_file, check_files=False).engine.live_slots == 2


WRITE_THEN_SIGTERM = """
import os, signal, sys
from appliance.benchmark import apply
real_fsync = os.fsync
def fsync_then_sigterm(descriptor):
    os.kill(os.getpid(), signal.SIGTERM)  # the default action: the process ends, no handler runs
    real_fsync(descriptor)
os.fsync = fsync_then_sigterm
apply.write_atomic(sys.argv[1], "engine:\\n  live_slots: 2\\n")
print("not reached: the SIGTERM ends the process once the write is done")
"""


def test_a_sigterm_during_the_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("engine:\n  live_slots: 4\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", WRITE_THEN_SIGTERM, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert [entry.name for entry in tmp_path.iterdir()] == ["appliance.yaml"]
    assert path.read_text(encoding="utf-8") == "engine:\n  live_slots: 2\n"  # held off until the rename


def test_an_exception_during_the_write_leaves_no_temporary_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "appliance.yaml"
    path.write_text("old\n", encoding="utf-8")

    def interrupted_chmod(target: Any, mode: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "chmod", interrupted_chmod)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new\n")
    assert [entry.name for entry in tmp_path.iterdir()] == ["appliance.yaml"]
    assert path.read_text(encoding="utf-8") == "old\n"


def test_a_hard_linked_config_is_refused_and_both_names_keep_the_file(config_file: Path) -> None:
    other = config_file.parent / "backup.yaml"
    os.link(config_file, other)
    before = config_file.read_bytes()
    with pytest.raises(apply_module.ConfigNotWritable, match="has 2 hard links") as refused:
        apply_changes(config_file, {"engine.live_slots": 2})
    assert not refused.value.read_only
    assert config_file.read_bytes() == before and other.read_bytes() == before
    assert os.stat(config_file).st_ino == os.stat(other).st_ino  # still one file under two names
    assert sorted(path.name for path in config_file.parent.iterdir()) == ["appliance.yaml", "backup.yaml"]


def immutable(path: Path) -> bool:
    """Give ``path`` the immutable attribute (root, a file system that has it); False where it cannot."""
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0


def test_an_immutable_config_is_refused_with_the_command_to_run_as_root(config_file: Path) -> None:
    if not immutable(config_file):
        pytest.skip("needs root and chattr +i")
    before = config_file.read_bytes()
    try:
        with pytest.raises(apply_module.ConfigNotWritable, match="not writable by this process") as refused:
            apply_changes(config_file, {"engine.live_slots": 2})
    finally:
        subprocess.run(["chattr", "-i", str(config_file)], check=True)
    assert refused.value.read_only
    assert config_file.read_bytes() == before
    assert sorted(path.name for path in config_file.parent.iterdir()) == ["appliance.yaml"]


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES, errno.EPERM])
def test_a_read_only_file_system_found_at_the_write_is_refused_clearly(
    config_file: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """The check before writing passed, the file system refused anyway (made read-only meanwhile)."""
    before = config_file.read_bytes()

    def refusing_mkstemp(*args: Any, **kwargs: Any) -> Any:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(filewrite.tempfile, "mkstemp", refusing_mkstemp)
    with pytest.raises(apply_module.ConfigNotWritable, match=f"cannot write .*{re.escape(os.strerror(error))}"):
        apply_changes(config_file, {"engine.live_slots": 2})
    assert config_file.read_bytes() == before


def test_the_command_to_apply_as_root_is_one_the_cli_takes(tmp_path: Path) -> None:
    command = apply_module.root_command(Path("/var/lib/appliance/benchmarks/r 1.json"),
                                        Path("/etc/appliance/appliance.yaml"), Path("/run/appliance/appliance.sock"))
    words = shlex.split(command)
    assert words[0] == "sudo" and Path(words[1]).name == "appliance"
    from appliance.cli import build_parser

    args = build_parser().parse_args(words[2:])
    assert args.command == "benchmark" and args.apply is True
    assert args.result == "/var/lib/appliance/benchmarks/r 1.json"
    assert args.config == "/etc/appliance/appliance.yaml" and args.socket == "/run/appliance/appliance.sock"


def test_the_cli_gives_a_user_the_command_to_run_and_root_only_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from appliance import cli

    def a_user() -> int:
        return 1000

    def root() -> int:
        return 0

    config = tmp_path / "appliance.yaml"
    result = tmp_path / "result.json"
    refused = apply_module.ConfigNotWritable(config, f"{config} is not writable by this process (a read-only file "
                                             f"system)", read_only=True)
    monkeypatch.setattr(os, "geteuid", a_user)
    as_user = cli.not_writable(refused, result, config)
    assert as_user == (f"cannot apply the advice: {config} is not writable by this process (a read-only file "
                       f"system); apply it as root: {apply_module.root_command(result, config)}")
    monkeypatch.setattr(os, "geteuid", root)
    assert cli.not_writable(refused, result, config) == f"cannot apply the advice: {refused.message}"
    linked = apply_module.ConfigNotWritable(config, f"{config} has 2 hard links", read_only=False)
    monkeypatch.setattr(os, "geteuid", a_user)
    assert "sudo" not in cli.not_writable(linked, result, config)  # root would not help

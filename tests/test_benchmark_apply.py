"""``appliance benchmark --apply`` (issue #13): the advised keys are written into a copy of the repository's own,
heavily commented ``appliance.yaml`` and nothing else in it changes; a bad change is refused; the write is
atomic."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from appliance.benchmark import advice
from appliance.benchmark import apply as apply_module
from appliance.benchmark.apply import AdviceRejected, advised_text, apply_changes, unified_diff, write_atomic
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
        max_in_flight=2,
        models=(advice.ModelFootprint("demo", 20 * advice.MIB, 32 * advice.MIB),),
        max_connections=config.max_connections,
        current=advice.current_settings(config),
    )
    _, recommendations = advice.advise(measurements)
    wanted = advice.changes(recommendations)
    assert wanted  # a low box: the window, sample rate, slack, thresholds and slots all move

    applied = apply_changes(config_file, wanted)

    assert set(applied.keys) == set(wanted)
    after = advice.current_settings(load_config(config_file, check_files=False))
    for recommendation in recommendations:
        if recommendation.key is not None:
            assert after[recommendation.key] == recommendation.value
    assert advice.changes(
        [dataclasses.replace(recommendation, current=after.get(recommendation.key))
         for recommendation in recommendations]) == {}

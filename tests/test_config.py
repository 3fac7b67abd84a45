"""appliance.yaml: schema, validation (C2), defaults, path resolution, diff (C3), docs."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config import schema
from appliance.config.validate import (
    CLASSES,
    Config,
    ConfigInvalid,
    EngineConfig,
    ModelConfig,
    Problem,
    TinySpec,
    default_config,
    diff,
    load_config,
    parse_config,
    parse_size,
    render_docs,
)
from appliance.errors import ApplianceError

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "appliance.yaml"
MODEL = "models:\n  - name: m\n    path: /models/m.gguf\n"


def parse(text: str, **kwargs) -> Config:
    kwargs.setdefault("check_files", False)
    kwargs.setdefault("base_dir", Path("/base"))
    return parse_config(textwrap.dedent(text), **kwargs)


def problems(text: str, **kwargs) -> tuple[Problem, ...]:
    with pytest.raises(ConfigInvalid) as info:
        parse(text, **kwargs)
    return info.value.problems


def only(text: str, **kwargs) -> Problem:
    found = problems(text, **kwargs)
    assert len(found) == 1, [str(p) for p in found]
    return found[0]


# --- the shipped file ---------------------------------------------------------------------------------------


def test_shipped_config_validates_without_file_checks():
    config = load_config(SHIPPED, check_files=False)
    assert [m.name for m in config.models] == ["demo", "demo-wide"]
    assert config.model("demo").generate_if_missing == TinySpec(layers=4, dim=256, seed=0)
    assert config.model("demo-wide").generate_if_missing.layers == 2
    assert config.model("demo-wide").generate_if_missing.dim == 384
    assert all(m.path.is_relative_to(REPO / "data" / "models") for m in config.models)
    assert config.http.host == "127.0.0.1" and config.http.port == 8080
    assert config.socket.mode == 0o660


def test_shipped_config_validates_when_no_model_file_exists():
    """Every shipped model has generate_if_missing, so a fresh machine (no files yet) validates."""
    seen: list[Path] = []
    config = load_config(SHIPPED, check_files=lambda p: seen.append(p) or False)
    assert len(config.models) == 2 and seen == []


def test_file_check_fires_for_a_shipped_model_without_generate_if_missing():
    text = SHIPPED.read_text().replace("generate_if_missing: {layers: 2, dim: 384, seed: 1}", "")
    with pytest.raises(ConfigInvalid) as info:
        parse_config(text, source=SHIPPED, check_files=lambda p: False)
    (problem,) = info.value.problems
    assert problem.path == "models[1].path" and "demo-wide.gguf" in problem.message


DEMO_CHOICES = {"agent_idle_ttl_s": 3600.0}
"""Settings the shipped demo config sets away from the default (agents of closed ``nc`` sessions expire)."""


def test_shipped_config_spells_out_the_documented_defaults():
    """The shipped file and the schema agree: whatever the file states equals the declared default."""
    shipped = load_config(SHIPPED, check_files=False)
    defaults = default_config(REPO)
    for s in schema.SETTINGS:
        if s.key.startswith("models"):
            continue
        expected = DEMO_CHOICES.get(s.key, _get(defaults, s.key))
        assert _get(shipped, s.key) == expected, s.key


def _get(obj, key: str):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


# --- all problems at once, with lines ------------------------------------------------------------------------


def test_three_mistakes_give_exactly_three_problems_with_lines_and_paths():
    text = """\
        data_dir: ./data
        engine:
          warmup_runs: 8
          adaptive_windw_size: 64
        max_connections: "many"
        admission_percent: 0
        models:
          - name: demo
            path: ./m.gguf
        """
    found = problems(text, source=Path("appliance.yaml"))
    assert [(p.line, p.path) for p in found] == [
        (4, "engine.adaptive_windw_size"), (5, "max_connections"), (6, "admission_percent")]
    assert "did you mean 'adaptive_window_size'" in found[0].message
    assert "integer" in found[1].message
    assert str(found[2]) == "appliance.yaml:6: admission_percent: must be ≥ 1 (got 0)"


def test_error_carries_every_problem_in_the_p4_shape():
    with pytest.raises(ConfigInvalid) as info:
        parse("max_connections: 0\nlog_level: loud\n", source=Path("/etc/appliance.yaml"))
    error = info.value.error
    assert isinstance(error, ApplianceError) and error.code == "CONFIG_INVALID"
    assert error.details["source"] == "/etc/appliance.yaml"
    assert [p["path"] for p in error.details["problems"]] == ["max_connections", "log_level"]
    assert [p["line"] for p in error.details["problems"]] == [1, 2]
    assert "2 problems" in error.message
    assert str(info.value).splitlines()[0].startswith("/etc/appliance.yaml:1: max_connections: must be ≥ 1")


def test_yaml_syntax_error_is_reported_with_its_line():
    problem = only("data_dir: ./data\nengine: {warmup_runs: 8\nlog_level: info\n")
    assert problem.line in (2, 3) and problem.path == "" and "YAML syntax error" in problem.message


def test_yaml_syntax_error_line_for_bad_indentation():
    problem = only("engine:\n  warmup_runs: 8\n   threads: 2\n")
    assert problem.line == 3 and "YAML" in problem.message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(text):
    problem = only(text)
    assert problem.line == 1 and "top level" in problem.message


# --- each rule -----------------------------------------------------------------------------------------------

RULES = [
    # (text, path, line, fragment of the message)
    ("logging: info\n", "logging", 1, "unknown key 'logging'"),
    ("log_levle: info\n", "log_levle", 1, "did you mean 'log_level'"),
    ("engine:\n  warmup_run: 3\n", "engine.warmup_run", 2, "did you mean 'warmup_runs'"),
    ("warmup_runs: 3\n", "warmup_runs", 1, "belongs at 'engine.warmup_runs'"),
    ("max_connections: true\n", "max_connections", 1, "must be an integer (got true)"),
    ("max_connections: '128'\n", "max_connections", 1, "must be an integer (got '128')"),
    ("engine:\n  threads: 1.5\n", "engine.threads", 2, "must be an integer"),
    ("admission_percent: yes\n", "admission_percent", 1, "must be a number (got true)"),
    ("engine: {async_switch: 1}\n", "engine.async_switch", 1, "must be true or false"),
    ("admission_percent: 101\n", "admission_percent", 1, "must be ≤ 100"),
    ("resync_interval_s: -1\n", "resync_interval_s", 1, "must be ≥ 0"),
    ("http: {port: 70000}\n", "http.port", 1, "must be ≤ 65535"),
    ("log_level: loud\n", "log_level", 1, "must be one of debug, info"),
    ("max_frame_bytes: lots\n", "max_frame_bytes", 1, "size like"),
    ("max_frame_bytes: 10\n", "max_frame_bytes", 1, "must be ≥ 1KiB"),
    ("max_frame_bytes: 2GiB\n", "max_frame_bytes", 1, "must be ≤ 1GiB"),
    ("device: gpu\n", "device", 1, "auto, host, nvml:N or fake:<size>"),
    ("device: 'nvml:'\n", "device", 1, "nvml:N"),
    ("device: 'fake:0'\n", "device", 1, "fake:<size>"),
    ("device: 'fake:lots'\n", "device", 1, "fake:<size>"),
    ("device: 'host:1'\n", "device", 1, "fake:<size>"),
    ("socket: {mode: '0666'}\n", "socket.mode", 1, "others"),
    ("socket: {mode: rw}\n", "socket.mode", 1, "octal"),
    ("engine: {thread_idle_thresholds: [30, 60]}\n", "engine.thread_idle_thresholds", 1, "first above second"),
    ("engine: {thread_idle_thresholds: [160, 60]}\n", "engine.thread_idle_thresholds", 1, "percentages"),
    ("engine: {plan_boundaries: [512, 128]}\n", "engine.plan_boundaries", 1, "first below second"),
    ("engine: {plan_boundaries: [128]}\n", "engine.plan_boundaries", 1, "two integers"),
    ("engine: {plan_boundaries: 128}\n", "engine.plan_boundaries", 1, "two integers"),
    ("engine: 5\n", "engine", 1, "must be a mapping"),
    ("models: {name: m}\n", "models", 1, "must be a list"),
    ("models:\n  - just-a-name\n", "models[0]", 2, "must be a mapping"),
    ("models:\n  - name: m\n", "models[0].path", 2, "required key 'path' is missing"),
    ("models:\n  - path: /m.gguf\n", "models[0].name", 2, "required key 'name' is missing"),
    ("models:\n  - {name: 'my model', path: /m.gguf}\n", "models[0].name", 2, "letters, digits"),
    ("models:\n  - {name: m, path: /m.gguf, n_ctx: 8}\n", "models[0].n_ctx", 2, "must be ≥ 16 (got 8)"),
    ("models:\n  - {name: m, path: /m.gguf, n_gpu_layers: -2}\n", "models[0].n_gpu_layers", 2, "≥ -1"),
    ("models:\n  - {name: m, path: /m.gguf, vram_bytes: lots}\n", "models[0].vram_bytes", 2, "size like"),
    ("models:\n  - {name: m, path: /m.gguf, cache_type: f8}\n", "models[0].cache_type", 2, "one of"),
    ("models:\n  - {name: m, path: /m.gguf, size: 1}\n", "models[0].size", 2, "unknown key 'size'"),
    ("models:\n  - name: m\n    path: /m.gguf\n    generate_if_missing: {layers: 4}\n",
     "models[0].generate_if_missing.dim", 4, "required key 'dim'"),
    ("models:\n  - name: m\n    path: /m.gguf\n    generate_if_missing: {layers: 4, dim: 200}\n",
     "models[0].generate_if_missing.dim", 4, "multiple of 64"),
    ("models:\n  - name: m\n    path: /m.gguf\n    generate_if_missing: yes\n",
     "models[0].generate_if_missing", 4, "must be a mapping"),
    ("http: {host: 0.0.0.0}\n", "http.host", 1, "requires http.api_token"),
    ("http: {api_token: 12345}\n", "http.api_token", 1, "quote it"),
    ("log_level:\n", "log_level", 1, "must not be empty (default: 'info')"),
    ("log_level: info\nlog_level: debug\n", "log_level", 2, "duplicate key (first at line 1)"),
    ("model_dirs: ./models\n", "model_dirs", 1, "list of folders"),
    ("data_dir: '{data_dir}/x'\n", "data_dir", 1, "itself"),
    ("1: x\n", "1", 1, "unknown key"),
]


@pytest.mark.parametrize(("text", "path", "line", "fragment"), RULES, ids=[r[1] + ":" + r[3] for r in RULES])
def test_each_rule(text, path, line, fragment):
    problem = only(text)
    assert problem.path == path
    if line is not None:
        assert problem.line == line
    assert fragment in problem.message, problem.message


def test_unknown_key_suggestion_is_reported_at_the_key_line():
    problem = only("data_dir: ./d\n\nlog_levle: info\n")
    assert (problem.path, problem.line) == ("log_levle", 3)


def test_duplicate_model_names():
    problem = only("models:\n  - {name: m, path: /a.gguf}\n  - {name: n, path: /b.gguf}\n"
                   "  - {name: m, path: /c.gguf}\n")
    assert (problem.path, problem.line) == ("models[2].name", 4)
    assert "duplicate model name 'm'" in problem.message and "models[0]" in problem.message


def test_missing_model_file_is_a_problem_unless_generate_if_missing(tmp_path):
    (tmp_path / "there.gguf").write_bytes(b"GGUF")
    text = ("models:\n  - {name: a, path: there.gguf}\n  - {name: b, path: gone.gguf}\n"
            "  - {name: c, path: also-gone.gguf, generate_if_missing: {layers: 1, dim: 64}}\n")
    found = problems(text, base_dir=tmp_path, check_files=True)
    assert [(p.path, p.line) for p in found] == [("models[1].path", 3)]
    assert str(tmp_path / "gone.gguf") in found[0].message
    assert parse(text, base_dir=tmp_path, check_files=False).model("b").path == tmp_path / "gone.gguf"


def test_check_files_callable_gets_resolved_paths():
    seen: list[Path] = []
    parse("models:\n  - {name: a, path: sub/a.gguf}\n", check_files=lambda p: seen.append(p) or True)
    assert seen == [Path("/base/sub/a.gguf")]


def test_model_path_outside_model_dirs_is_fine_for_configured_models():
    config = parse("model_dirs: [/only/here]\nmodels:\n  - {name: m, path: /elsewhere/m.gguf}\n")
    assert config.model("m").path == Path("/elsewhere/m.gguf")
    assert config.model_dirs == (Path("/only/here"),)


def test_all_problems_reported_across_sections():
    text = """\
        device: gpu
        socket: {mode: "0777"}
        engine: {warmup_runs: -1, bogus: 1}
        models:
          - {name: a, path: /a.gguf, n_ctx: 1}
          - {name: a, path: /b.gguf}
        """
    found = problems(text)
    assert [p.path for p in found] == ["device", "socket.mode", "engine.bogus", "engine.warmup_runs",
                                       "models[0].n_ctx", "models[1].name"]
    assert [p.line for p in found] == [1, 2, 3, 3, 5, 6]


def test_yaml_anchors_and_merge_keys_work():
    config = parse("models:\n  - &base {name: a, path: /a.gguf, n_ctx: 1024}\n  - <<: *base\n    name: b\n")
    assert config.model("b").n_ctx == 1024 and config.model("b").path == Path("/a.gguf")
    found = problems("models:\n  - &base {name: a, path: /a.gguf}\n  - <<: *base\n    nctx: 1\n")
    assert [(p.path, p.line) for p in found] == [("models[1].name", 2), ("models[1].nctx", 4)]


def test_a_key_written_in_the_mapping_overrides_the_merged_one_and_duplicates_are_still_refused():
    config = parse("models:\n  - &base {name: a, path: /a.gguf, n_ctx: 1024}\n"
                   "  - <<: *base\n    name: b\n    n_ctx: 4096\n")
    assert config.model("b").n_ctx == 4096 and config.model("a").n_ctx == 1024
    problem = only("models:\n  - &base {name: a, path: /a.gguf}\n  - <<: *base\n    name: b\n    name: c\n")
    assert (problem.path, problem.line) == ("models[1].name", 5)
    assert problem.message == "duplicate key (first at line 4)"


def test_a_bad_merge_key_is_a_problem_of_its_mapping():
    problem = only("engine:\n  <<: 5\n")
    assert (problem.path, problem.line) == ("engine", 2) and "bad merge key" in problem.message


def test_an_unknown_key_that_names_a_section_says_where_it_belongs():
    problem = only("generate_if_missing: {layers: 1, dim: 64}\n")
    assert problem.message == "unknown key 'generate_if_missing' (it belongs at 'models[].generate_if_missing')"


def test_problem_and_error_without_line_or_path():
    problem = Problem("", None, "cannot read the file: boom", "x.yaml")
    assert str(problem) == "x.yaml: cannot read the file: boom"
    assert str(Problem("http.port", 3, "must be ≤ 65535")) == "appliance.yaml:3: http.port: must be ≤ 65535"
    error = ConfigInvalid([problem]).error
    assert error.message == str(problem) and error.details["source"] is None
    assert ConfigInvalid([]).error.message == "invalid"


def test_load_config_of_a_missing_file_is_config_invalid(tmp_path):
    with pytest.raises(ConfigInvalid) as info:
        load_config(tmp_path / "nope.yaml")
    assert "cannot read" in info.value.problems[0].message


# --- accepted values, defaults and paths ---------------------------------------------------------------------


def test_defaults_applied_when_omitted():
    config = parse(MODEL)
    assert config.admission_percent == 90 and config.device == "auto" and config.max_connections == 128
    assert config.max_frame_bytes == 16 * 1024 * 1024 and config.heartbeat_interval_s == 2.0
    assert config.engine == EngineConfig(64, 4, 1.2, True, (60, 30), 8, (128, 512), 0, 4, "auto", None, True)
    assert config.http.host == "127.0.0.1" and config.http.port == 8080 and config.http.api_token is None
    assert config.socket.mode == 0o660 and config.socket.group is None
    m = config.model("m")
    assert (m.vram_bytes, m.n_ctx, m.n_gpu_layers, m.idle_ttl_s, m.cache_type, m.generate_if_missing) == (
        None, 2048, 0, 1800.0, "f16", None)


def test_default_config_has_every_default_and_no_models(tmp_path):
    config = default_config(tmp_path)
    assert config.models == () and config.source is None and config.base_dir == tmp_path
    assert config.data_dir == tmp_path / "data"
    assert config.socket.path == tmp_path / "data" / "appliance.sock"
    assert config.model_dirs == (tmp_path / "data" / "models",)
    for text in ("", "# only a comment\n", "~\n"):
        assert parse(text, base_dir=tmp_path) == config


def test_accepted_values():
    config = parse("""\
        device: fake:8GiB
        admission_percent: 50
        max_frame_bytes: 1.5MB
        socket: {mode: 0600, group: gpu}
        http: {host: 0.0.0.0, api_token: s3cret}
        engine: {async_switch: false, thread_idle_thresholds: [80, 20]}
        models:
          - {name: m.v1:q4, path: /m.gguf, vram_bytes: 300MiB, n_gpu_layers: -1, idle_ttl_s: 0}
          - {name: n, path: /n.gguf, vram_bytes: 1000, generate_if_missing: null}
        """)
    assert config.device == "fake:8GiB" and config.admission_percent == 50.0
    assert isinstance(config.admission_percent, float)
    assert config.max_frame_bytes == 1_500_000
    assert config.socket.mode == 0o600 and config.socket.group == "gpu"
    assert config.http.api_token == "s3cret"
    assert config.engine.thread_idle_thresholds == (80, 20) and config.engine.async_switch is False
    assert config.model("m.v1:q4").vram_bytes == 300 * 1024**2 and config.model("n").vram_bytes == 1000
    assert config.model("n").generate_if_missing is None


@pytest.mark.parametrize(("text", "mode"), [("'0660'", 0o660), ("660", 0o660), ("0640", 0o640),
                                            ("'0o600'", 0o600)])
def test_socket_mode_is_read_as_octal_however_written(text, mode):
    assert parse(f"socket: {{mode: {text}}}\n").socket.mode == mode


@pytest.mark.parametrize(("spec", "expected"), [("auto", "auto"), ("host", "host"), ("HOST", "host"),
                                                ("nvml:0", "nvml:0"), ("nvml:01", "nvml:1"),
                                                ("fake:512MiB", "fake:512MiB"), ("fake: 2G", "fake:2G")])
def test_device_specs(spec, expected):
    assert parse(f"device: '{spec}'\n").device == expected


def test_relative_paths_resolve_against_the_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "appliance.yaml").write_text(textwrap.dedent("""\
        data_dir: ./state
        model_dirs: [models, /abs/models, "{data_dir}/more", ~/mine]
        models:
          - {name: m, path: ../weights/m.gguf}
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    config = load_config(Path("etc/appliance.yaml"), check_files=False)
    assert config.source == Path("etc/appliance.yaml") and config.base_dir == folder
    assert config.data_dir == folder / "state"
    assert config.model_dirs == (folder / "models", Path("/abs/models"), folder / "state" / "more",
                                 tmp_path / "home" / "mine")
    assert config.socket.path == folder / "state" / "appliance.sock"
    assert config.model("m").path == tmp_path / "weights" / "m.gguf"


def test_explicit_base_dir_wins_over_the_source_folder():
    config = parse_config("data_dir: d\n", source=Path("/x/appliance.yaml"), base_dir=Path("/y"))
    assert config.data_dir == Path("/y/d")


def test_with_overrides_and_model_lookup():
    config = parse(MODEL)
    assert config.model("m").name == "m" and config.model("nope") is None
    changed = config.with_overrides(admission_percent=50.0)
    assert changed.admission_percent == 50.0 and config.admission_percent == 90.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "host"  # type: ignore[misc]


# --- sizes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "n"), [
    (0, 0), (4096, 4096), ("1024", 1024), ("8GiB", 8 * 1024**3), ("512 MiB", 512 * 1024**2),
    ("16ki", 16 * 1024), ("2G", 2 * 10**9), ("1.5GB", 1_500_000_000), ("100k", 100_000), ("3B", 3),
    ("1TiB", 1024**4), ("0.5KiB", 512), ("1.1KiB", 1126), ("100 b", 100), ("8gib", 8 * 1024**3),
    ("2Gi", 2 * 1024**3), ("1.5GiB", 3 * 2**29), ("4K", 4000), ("4kB", 4000), ("3MB", 3_000_000),
    ("1TB", 10**12), ("  7 MiB  ", 7 * 1024**2), (".5KiB", 512), ("2.KiB", 2048), ("1.5", 1)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", [-1, True, 1.5, 8e9, None, "", " ", "GiB", "8 XB", "8XB", "8 GiBs", "8 G iB",
                                  "1.2.3G", "-5MiB", "-1", "1e9", "8,5GB", "0x10", [1]])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="must"):
        parse_size(text)


def test_parse_size_message_is_helpful():
    with pytest.raises(ValueError, match=r"size like '16MiB', '2G' \(got '8XB'\)"):
        parse_size("8XB")


@given(st.integers(min_value=0, max_value=2**50))
def test_format_size_round_trips(n):
    assert parse_size(schema.format_size(n)) == n


# --- diff -----------------------------------------------------------------------------------------------------

BASE = textwrap.dedent("""\
    admission_percent: 90
    models:
      - {name: a, path: /a.gguf}
      - {name: b, path: /b.gguf}
    """)


def test_diff_nothing_changed():
    d = diff(parse(BASE), parse(BASE + "# a comment\n"))
    assert d.empty and str(d) == "no changes"
    assert d == diff(parse(BASE), parse(BASE))


def test_diff_model_added_and_removed():
    new = BASE.replace("{name: b, path: /b.gguf}", "{name: c, path: /c.gguf}")
    d = diff(parse(BASE), parse(new))
    assert (d.added_models, d.removed_models, d.changed_models) == (("c",), ("b",), ())
    assert not d.empty and d.changed_settings == ()
    assert "added models: c" in d.summary() and "removed models: b" in d.summary()


def test_diff_model_changed_needs_reload_only_for_non_live_keys():
    new = BASE.replace("{name: a, path: /a.gguf}", "{name: a, path: /a.gguf, n_ctx: 4096}").replace(
        "{name: b, path: /b.gguf}", "{name: b, path: /b.gguf, idle_ttl_s: 60}")
    d = diff(parse(BASE), parse(new))
    assert d.changed_models == ("a", "b") and d.reload_models == ("a",)
    assert d.model_fields == {"a": ("n_ctx",), "b": ("idle_ttl_s",)}
    assert "a (n_ctx)" in d.summary() and d.added_models == d.removed_models == ()


def test_diff_engine_knob_and_settings_changed():
    new = BASE.replace("admission_percent: 90", "admission_percent: 80\nengine: {warmup_runs: 3}\n"
                       "http: {port: 9090}\ndevice: host")
    d = diff(parse(BASE), parse(new))
    assert d.changed_settings == ("device", "admission_percent", "http.port", "engine.warmup_runs")
    assert d.restart_settings == ("device",)  # http.port is rebound by a reload
    assert d.changed_models == () and not d.empty
    assert "changed settings: device, admission_percent, http.port, engine.warmup_runs" in str(d)


def test_diff_ignores_where_the_file_was_read_from():
    text = "data_dir: /state\n" + BASE
    assert diff(parse(text, base_dir=Path("/x")), parse(text, source=Path("/y/a.yaml"))).empty


# --- schema and docs ------------------------------------------------------------------------------------------


def test_every_setting_has_a_dataclass_field_and_back():
    for section, cls in CLASSES.items():
        settings_, subs = schema.members(section)
        names = {f.name for f in dataclasses.fields(cls)} - {"source", "base_dir", "lines"}  # not settings
        assert names == set(settings_) | set(subs), section


def test_every_default_is_valid():
    for s in schema.SETTINGS:
        if not s.required and s.default is not None:
            s.kind.convert(s.default)
    assert ModelConfig.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_render_docs_mentions_every_setting_and_section():
    docs = render_docs()
    for s in schema.SETTINGS:
        assert f"`{s.key}`" in docs and s.kind.name in docs
    for sec in schema.SECTIONS:
        assert f"## `{sec.key}`" in docs


def test_shipped_docs_are_render_docs_output():
    assert (REPO / "docs" / "configuration.md").read_text() == render_docs(), (
        "regenerate: python -m appliance.config.schema > docs/configuration.md")


def test_describe_spells_choices_bounds_and_null():
    assert schema.BY_KEY["max_frame_bytes"].describe().endswith("(range 1KiB..1GiB)")
    assert schema.BY_KEY["models[].idle_ttl_s"].describe().endswith("(≥ 0)")
    assert schema.BY_KEY["log_level"].describe() == "Log verbosity. (one of: debug, info, warning, error, critical)"
    assert schema.BY_KEY["socket.group"].describe().endswith("(may be null)")
    assert schema.BY_KEY["engine.async_switch"].describe().startswith("Adaptive engine: build the next pool/plan")


def test_members_of_each_section():
    settings_, subs = schema.members("models")
    assert list(settings_) == ["name", "aliases", "path", "vram_bytes", "n_ctx", "n_gpu_layers", "idle_ttl_s",
                               "embeddings", "reasoning", "cache_type"]
    assert list(subs) == ["generate_if_missing"]
    settings_, subs = schema.members("")
    assert list(subs) == ["socket", "http", "engine", "models"] and "data_dir" in settings_
    assert [s.prefix for s in schema.SECTIONS] == ["socket.", "http.", "engine.", "models[].",
                                                    "models[].generate_if_missing."]


def test_render_help_lists_every_key():
    text = schema.render_help()
    assert all(s.key in text for s in schema.SETTINGS)


# --- robustness -----------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_gives_a_config_or_config_invalid(text):
    try:
        parse_config(text, base_dir=Path("/b"), check_files=False)
    except ConfigInvalid as exc:
        assert exc.problems and all(isinstance(p, Problem) for p in exc.problems)


_KEYS = [s.key.rpartition(".")[2] for s in schema.SETTINGS] + ["engine", "socket", "http", "models", "bogus"]
_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False)
                       | st.sampled_from(["auto", "host", "16MiB", "0660", "m", "/m.gguf", "info", "f16"]),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner,
                                                                                   max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=6))
def test_any_yaml_mapping_gives_a_config_or_config_invalid(data):
    text = yaml.safe_dump(data)
    try:
        parse_config(text, base_dir=Path("/b"), check_files=False)
    except ConfigInvalid as exc:
        assert exc.problems and all(p.line is None or p.line >= 1 for p in exc.problems)


# -- hostile YAML: bounded size, depth, aliases; numbers that are not numbers ----------------------------------
def _laughs(levels: int, name: str = "a") -> str:
    """The "billion laughs": each level a list of ten aliases of the one before (10**levels strings)."""
    text = f"{name}0: &{name}0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for level in range(1, levels + 1):
        refs = ", ".join([f"*{name}{level - 1}"] * 10)
        text += f"{name}{level}: &{name}{level} [{refs}]\n"
    return text


HOSTILE_YAML = [
    ("billion-laughs", _laughs(9), 5, "more than 20000 values with aliases expanded"),
    ("laughs-in-a-setting", _laughs(3) + "model_dirs: [" + ", ".join(["*a3"] * 20) + "]\n", 5,
     "more than 20000 values"),
    ("many-aliases", "x: &x 1\ny: [" + ", ".join(["*x"] * 500) + "]\n", 2, "more than 100 aliases (limit 100)"),
    ("deep-block", "".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v\n", 33,
     "nested deeper than 32 levels"),
    ("deep-flow", "engine: " + "[" * 50_000 + "]" * 50_000 + "\n", 1, ""),
    ("recursive-alias", "model_dirs: &d [*d]\n", 1, "names no complete anchor"),
    ("wide", "model_dirs: [" + ", ".join(["a"] * 200_000) + "]\n", 1, "more than 20000 values"),
]


@pytest.mark.parametrize(("text", "line", "says"), [case[1:] for case in HOSTILE_YAML],
                         ids=[case[0] for case in HOSTILE_YAML])
def test_hostile_yaml_is_refused_quickly_with_its_line(text: str, line: int, says: str):
    import time

    started = time.perf_counter()
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(text, check_files=False)
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"took {elapsed:.2f} s"
    (problem,) = caught.value.problems
    assert problem.line == line and says in problem.message


def test_a_config_file_over_1_mib_is_refused_unread(tmp_path: Path):
    import time

    from appliance.config.validate import MAX_CONFIG_BYTES

    big = tmp_path / "appliance.yaml"
    big.write_bytes(b"# " + b"x" * (50 * 1024 * 1024) + b"\nmodels: []\n")
    started = time.perf_counter()
    with pytest.raises(ConfigInvalid) as caught:
        load_config(big, check_files=False)
    assert time.perf_counter() - started < 1.0
    (problem,) = caught.value.problems
    assert f"limit {MAX_CONFIG_BYTES} bytes" in problem.message
    with pytest.raises(ConfigInvalid, match="larger than 1024 KiB"):
        parse_config("#" * (MAX_CONFIG_BYTES + 1), check_files=False)
    just_under = "models: []\n" + "#" * (MAX_CONFIG_BYTES - 20) + "\n"
    assert parse_config(just_under, check_files=False).models == ()


def test_aliases_and_merge_keys_within_the_budget_still_work():
    text = ("defaults: &defaults {n_ctx: 512, idle_ttl_s: 60}\n"
            "models:\n"
            "  - {<<: *defaults, name: a, path: /m/a.gguf}\n"
            "  - {<<: *defaults, name: b, path: /m/b.gguf, n_ctx: 1024}\n")
    text = text.replace("defaults: &defaults", "x-defaults: &defaults")
    with pytest.raises(ConfigInvalid, match="unknown key 'x-defaults'"):  # the alias is fine, the key is not
        parse(text)
    models = parse("model_dirs: &dirs [/m/a, /m/b]\n" + "models:\n  - {name: a, path: /m/a.gguf, n_ctx: &n 512}\n"
                   "  - {name: b, path: /m/b.gguf, n_ctx: *n}\n")
    assert [m.n_ctx for m in models.models] == [512, 512] and models.model_dirs == (Path("/m/a"), Path("/m/b"))


@pytest.mark.parametrize(("text", "path", "says"), [
    ("admission_percent: .nan\n", "admission_percent", "must be a finite number (got nan)"),
    ("heartbeat_interval_s: .inf\n", "heartbeat_interval_s", "must be"),
    ("heartbeat_interval_s: -.inf\n", "heartbeat_interval_s", "must be"),
    ("heartbeat_interval_s: " + "9" * 5000 + "\n", "heartbeat_interval_s", "number too large (5000 digits; limit 30)"),
    ("max_connections: " + "9" * 400 + "\n", "max_connections", "number too large (400 digits"),
    ("max_frame_bytes: " + "9" * 40 + "MiB\n", "max_frame_bytes", "number too large"),
    ("device: nvml:²\n", "device", "digits must be ASCII 0-9 (got '²')"),
    ("max_connections: ٣\n", "max_connections", "digits must be ASCII 0-9"),
])
def test_numbers_that_are_not_plain_numbers_are_clean_problems(text: str, path: str, says: str):
    (problem,) = problems(text)
    assert problem.path == path and problem.line == 1 and says in problem.message, problem

"""``appliance run --data-dir/--socket`` (systemd's state and runtime folders) override the config file's
``data_dir`` and ``socket.path``; ``{data_dir}/…`` paths follow the given ``data_dir``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.config.validate import Config, ConfigInvalid, load_config, parse_config

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "appliance.yaml"
SOURCE = Path("/etc/appliance/appliance.yaml")
STATE = Path("/var/lib/appliance")
RUN = Path("/run/appliance")

TEXT = """\
data_dir: ./data
model_dirs: ["{data_dir}/models", ./shared-models]
socket:
  path: "{data_dir}/appliance.sock"
models:
  - name: a
    path: "{data_dir}/models/a.gguf"
  - name: b
    path: ./b.gguf
"""
"""Paths of every kind: ``{data_dir}/…`` ones, and ones relative to the file's folder."""


def parse(text: str = TEXT, **overrides: Path) -> Config:
    return parse_config(text, source=SOURCE, check_files=False, **overrides)


def test_without_overrides_the_files_paths_resolve_against_its_folder() -> None:
    config = parse()
    assert config.data_dir == Path("/etc/appliance/data")
    assert config.socket.path == Path("/etc/appliance/data/appliance.sock")
    assert config.model_dirs == (Path("/etc/appliance/data/models"), Path("/etc/appliance/shared-models"))
    assert [model.path for model in config.models] == [Path("/etc/appliance/data/models/a.gguf"),
                                                       Path("/etc/appliance/b.gguf")]


def test_data_dir_replaces_the_files_and_data_dir_paths_follow_it() -> None:
    config = parse(data_dir=STATE)
    assert config.data_dir == STATE
    assert config.socket.path == STATE / "appliance.sock"
    assert config.model_dirs == (STATE / "models", Path("/etc/appliance/shared-models"))
    assert [model.path for model in config.models] == [STATE / "models" / "a.gguf", Path("/etc/appliance/b.gguf")]


def test_socket_path_replaces_the_files_and_nothing_else() -> None:
    config = parse(socket_path=RUN / "appliance.sock")
    assert config.socket.path == RUN / "appliance.sock"
    assert config.data_dir == Path("/etc/appliance/data")
    assert config.model_dirs[0] == Path("/etc/appliance/data/models")


def test_both_overrides_together() -> None:
    config = parse(data_dir=STATE, socket_path=RUN / "appliance.sock")
    assert (config.data_dir, config.socket.path) == (STATE, RUN / "appliance.sock")
    assert config.model("a").path == STATE / "models" / "a.gguf"


def test_socket_path_override_wins_over_a_socket_path_under_data_dir() -> None:
    """A socket written as {data_dir}/… still goes where --socket says, not under the new data_dir."""
    config = parse(data_dir=STATE, socket_path=Path("/tmp/elsewhere.sock"))
    assert config.socket.path == Path("/tmp/elsewhere.sock")


def test_relative_overrides_resolve_against_the_current_folder(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse(data_dir=Path("state"), socket_path=Path("run/../run/a.sock"))
    assert config.data_dir == tmp_path / "state"
    assert config.socket.path == tmp_path / "run" / "a.sock"
    assert config.model("a").path == tmp_path / "state" / "models" / "a.gguf"
    assert config.model("b").path == Path("/etc/appliance/b.gguf")  # the file's own relative paths: unchanged


def test_the_model_file_check_looks_under_the_given_data_dir() -> None:
    seen: list[Path] = []

    def exists(path: Path) -> bool:
        seen.append(path)
        return path.name == "b.gguf"

    with pytest.raises(ConfigInvalid) as info:
        parse_config(TEXT, source=SOURCE, check_files=exists, data_dir=STATE)
    assert seen == [STATE / "models" / "a.gguf", Path("/etc/appliance/b.gguf")]
    (problem,) = info.value.problems
    assert problem.path == "models[0].path" and str(STATE / "models" / "a.gguf") in problem.message


def test_data_dir_override_replaces_an_invalid_data_dir_in_the_file() -> None:
    """The file's value is not used at all; without the override it is an error."""
    text = TEXT.replace("data_dir: ./data", 'data_dir: "{data_dir}/x"')
    with pytest.raises(ConfigInvalid):
        parse(text)
    assert parse(text, data_dir=STATE).data_dir == STATE


def test_other_problems_still_count_with_overrides() -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse(TEXT + "admission_percent: 0\n", data_dir=STATE, socket_path=RUN / "a.sock")
    assert [problem.path for problem in info.value.problems] == ["admission_percent"]


def test_the_shipped_config_keeps_every_path_in_the_given_folders() -> None:
    """As installed: nothing of the shipped file's points into its own (read-only) folder."""
    config = load_config(SHIPPED, check_files=False, data_dir=STATE, socket_path=RUN / "appliance.sock")
    assert config.data_dir == STATE
    assert config.socket.path == RUN / "appliance.sock"
    assert all(folder.is_relative_to(STATE) for folder in config.model_dirs)
    assert config.models and all(model.path.is_relative_to(STATE / "models") for model in config.models)


@pytest.fixture
def read_only_folder(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "appliance.yaml").write_text(TEXT)
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


def test_load_config_from_a_read_only_folder(read_only_folder: Path, tmp_path: Path) -> None:
    before = sorted(read_only_folder.iterdir())
    config = load_config(read_only_folder / "appliance.yaml", check_files=False, data_dir=tmp_path / "state",
                         socket_path=tmp_path / "run" / "appliance.sock")
    assert config.source == read_only_folder / "appliance.yaml"
    assert config.data_dir == tmp_path / "state"
    assert config.socket.path == tmp_path / "run" / "appliance.sock"
    assert config.model("a").path == tmp_path / "state" / "models" / "a.gguf"
    assert config.model("b").path == read_only_folder / "b.gguf"
    assert sorted(read_only_folder.iterdir()) == before


# -- appliance run --host/--port: settings given on the command line -------------------------------------------------
HTTP_TEXT = TEXT + "http:\n  host: 127.0.0.1\n  port: 8080\n"


def test_command_line_settings_replace_the_files_http_host_and_port() -> None:
    config = parse_config(HTTP_TEXT, source=SOURCE, settings={"http.host": "::1", "http.port": "9001"})
    assert (config.http.host, config.http.port) == ("::1", 9001)
    assert parse_config(HTTP_TEXT, source=SOURCE, settings={"http.port": "0"}).http.port == 0  # any free port
    assert parse_config(HTTP_TEXT, source=SOURCE, settings={}).http.port == 8080


@pytest.mark.parametrize(("settings", "key", "message"), [
    ({"http.port": "70000"}, "http.port", "must be ≤ 65535 (got 70000) (given on the command line)"),
    ({"http.port": "-1"}, "http.port", "must be ≥ 0 (got -1) (given on the command line)"),
    ({"http.port": "eighty"}, "http.port", "must be an integer (got 'eighty') (given on the command line)"),
    ({"http.port": ""}, "http.port", "must not be empty (default: 8080) (given on the command line)"),
    ({"http.host": "0.0.0.0"}, "http.host", "binding to '0.0.0.0' (not loopback) requires http.api_token"),
])
def test_command_line_settings_are_validated_like_the_files(settings: dict[str, str], key: str,
                                                            message: str) -> None:
    with pytest.raises(ConfigInvalid) as info:
        parse_config(HTTP_TEXT, source=SOURCE, settings=settings)
    (problem,) = info.value.problems
    assert (problem.path, problem.line, problem.message) == (key, None, message)  # no line: not the file's value


def test_a_non_loopback_host_from_the_command_line_is_fine_with_the_files_token() -> None:
    text = HTTP_TEXT + "  api_token: s3cret-token\n"
    assert parse_config(text, source=SOURCE, settings={"http.host": "0.0.0.0"}).http.host == "0.0.0.0"


def test_a_loopback_host_from_the_command_line_replaces_the_files_refused_one() -> None:
    text = HTTP_TEXT.replace("host: 127.0.0.1", "host: 0.0.0.0")
    with pytest.raises(ConfigInvalid):
        parse_config(text, source=SOURCE)
    assert parse_config(text, source=SOURCE, settings={"http.host": "127.0.0.1"}).http.host == "127.0.0.1"


def test_only_settings_can_be_given() -> None:
    with pytest.raises(ValueError, match="not a setting"):
        parse_config(HTTP_TEXT, source=SOURCE, settings={"http.prt": "1"})

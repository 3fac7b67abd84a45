"""``appliance models add``: the entry it writes (pure, comments kept), the file checks and placement (real tiny GGUF
files, a real trial load), the refusals, and a running appliance picking the new model up with its hot reload."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import running

from appliance.config.validate import load_config, parse_config
from appliance.errors import ApplianceError
from appliance.models import entry
from appliance.models.add import COPY, add_model, destination

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "appliance.yaml"


def appliance(*args: str, timeout: float = 120, user: int | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own; ``user``: as that uid (setpriv, when this runs as root)."""
    command = [sys.executable, "-m", "appliance", *args]
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def comments(text: str) -> list[str]:
    return [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]


# --- the entry (pure) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("filename", "name"), [
    ("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf", "Qwen2.5-0.5B-Instruct-Q4_K_M"),
    ("my model (v2).GGUF", "my-model-v2"),
    ("x" * 80 + ".gguf", "x" * 64),
    ("ünïcode.gguf", "n-code"),
])
def test_a_name_is_made_from_the_file_name(filename: str, name: str) -> None:
    assert entry.model_name_for(filename) == name


def test_a_file_name_with_nothing_usable_needs_a_name() -> None:
    with pytest.raises(ApplianceError) as info:
        entry.model_name_for("---.gguf")
    assert info.value.code == "BAD_REQUEST" and "--name" in info.value.message


def test_a_name_or_alias_in_use_is_refused_naming_its_model() -> None:
    config = parse_config("models:\n  - {name: a, path: a.gguf, aliases: [gpt-4.1]}\n")
    assert entry.name_owner(config, "b") is None
    by_name = entry.name_owner(config, "a")
    by_alias = entry.name_owner(config, "gpt-4.1")
    assert by_name is not None and by_name.code == "MODEL_EXISTS" and by_name.details["as"] == "name"
    assert by_alias is not None and by_alias.details == {"name": "gpt-4.1", "model": "a", "as": "alias"}


def test_the_path_is_written_as_the_file_writes_its_folder() -> None:
    dirs = [Path("/var/lib/appliance/models"), Path("/srv/models")]
    raw = ["{data_dir}/models", "/srv/models/"]
    assert entry.written_path(raw, dirs, Path("/var/lib/appliance/models/q/x.gguf")) == "{data_dir}/models/q/x.gguf"
    assert entry.written_path(raw, dirs, Path("/srv/models/y.gguf")) == "/srv/models/y.gguf"
    with pytest.raises(ApplianceError) as info:
        entry.written_path(raw, dirs, Path("/home/me/z.gguf"))
    assert info.value.code == "FORBIDDEN"
    assert entry.raw_model_dirs("data_dir: /d\n", "f") == ["{data_dir}/models"]  # the default
    assert entry.raw_model_dirs('model_dirs: ["./m", /srv/models]  # here\n', "f") == ["./m", "/srv/models"]


def test_the_entry_goes_at_the_end_of_the_shipped_models_with_every_comment_kept() -> None:
    text = SHIPPED.read_text()
    new = entry.added_text(text, {"name": "qwen", "path": "{data_dir}/models/qwen.gguf", "n_ctx": 4096},
                           source=SHIPPED)
    assert new.startswith(text)  # nothing above changed
    assert new[len(text):] == '\n  - name: qwen\n    path: "{data_dir}/models/qwen.gguf"\n    n_ctx: 4096\n'
    assert comments(new) == comments(text)
    assert [m.name for m in parse_config(new, source=SHIPPED).models] == ["demo", "demo-wide", "qwen"]


def test_the_comments_after_the_list_stay_below_the_new_entry() -> None:
    text = textwrap.dedent("""\
        models:
        - name: a       # first
          path: a.gguf
          # about a, still
        # the engine section
        engine:
          threads: 0
        """)
    new = entry.added_text(text, {"name": "b", "path": "b.gguf"})
    assert new == textwrap.dedent("""\
        models:
        - name: a       # first
          path: a.gguf
          # about a, still
        - name: b
          path: b.gguf
        # the engine section
        engine:
          threads: 0
        """)


@pytest.mark.parametrize(("text", "expected"), [
    ("data_dir: ./d  # state\n", "data_dir: ./d  # state\n\nmodels:\n  - name: b\n    path: b.gguf\n"),
    ("models: []\n", "models:\n  - name: b\n    path: b.gguf\n"),
    ("# only a comment\n", "# only a comment\nmodels:\n  - name: b\n    path: b.gguf\n"),
])
def test_a_file_without_models_gets_the_list(text: str, expected: str) -> None:
    assert entry.added_text(text, {"name": "b", "path": "b.gguf"}) == expected


def test_an_entry_that_would_make_the_config_invalid_is_refused() -> None:
    with pytest.raises(ApplianceError) as info:
        entry.added_text("models:\n- name: a\n  path: a.gguf\n", {"name": "b", "path": "b.gguf", "n_ctx": 1})
    assert info.value.code == "CONFIG_INVALID" and "models[1].n_ctx" in info.value.message
    with pytest.raises(ApplianceError) as flow:
        entry.added_text("models: [{name: a, path: a.gguf}]\n", {"name": "b", "path": "b.gguf"})
    assert flow.value.code == "CONFIG_INVALID" and "by hand" in flow.value.message


# --- adding a real file -------------------------------------------------------------------------------------------


@pytest.fixture
def box(tmp_path: Path, tiny_model: Path) -> Path:
    """A config whose first model folder is ``<tmp>/state/models``, with one model, and a GGUF file outside it."""
    (tmp_path / "downloads").mkdir()
    shutil.copy(tiny_model, tmp_path / "downloads" / "Tiny Chat.gguf")
    (tmp_path / "state" / "models").mkdir(parents=True)
    shutil.copy(tiny_model, tmp_path / "state" / "models" / "demo.gguf")
    config = tmp_path / "appliance.yaml"
    config.write_text('data_dir: ./state  # the state folder\nmodel_dirs: ["{data_dir}/models"]\n\nmodels:\n'
                      '  - name: demo  # the demo\n    path: "{data_dir}/models/demo.gguf"\n    aliases: [gpt-4.1]\n')
    return config


def test_a_file_is_checked_linked_and_added(box: Path) -> None:
    source = box.parent / "downloads" / "Tiny Chat.gguf"
    added = add_model(box, source, n_ctx=512)
    target = box.parent / "state" / "models" / "Tiny Chat.gguf"
    assert (added.name, added.path, added.placed) == ("Tiny-Chat", target, "linked")
    assert os.path.samefile(target, source)  # a hard link: no second copy
    assert box.read_text().endswith('  - name: Tiny-Chat\n    path: "{data_dir}/models/Tiny Chat.gguf"\n'
                                     '    n_ctx: 512\n')
    config = load_config(box, check_files=True)
    assert config.model("Tiny-Chat").path == target and config.model("Tiny-Chat").n_ctx == 512
    assert "+  - name: Tiny-Chat" in added.diff
    moved = load_config(box, data_dir=box.parent / "elsewhere")  # the entry follows --data-dir
    assert moved.model("Tiny-Chat").path == box.parent / "elsewhere" / "models" / "Tiny Chat.gguf"


def test_a_copy_is_a_file_of_its_own_that_all_may_read(box: Path) -> None:
    source = box.parent / "downloads" / "Tiny Chat.gguf"
    source.chmod(0o600)
    added = add_model(box, source, name="tiny", placement=COPY)
    assert added.placed == "copied" and not os.path.samefile(added.path, source)
    assert added.path.read_bytes() == source.read_bytes()
    assert stat.S_IMODE(added.path.stat().st_mode) == 0o644 and added.notes == ()
    assert not [p for p in added.path.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_file_inside_a_model_folder_stays_where_it_is(box: Path, tiny_model_b: Path) -> None:
    inside = box.parent / "state" / "models" / "sub" / "b.gguf"
    inside.parent.mkdir()
    shutil.copy(tiny_model_b, inside)
    added = add_model(box, inside)
    assert (added.name, added.path, added.placed) == ("b", inside, "kept")
    assert 'path: "{data_dir}/models/sub/b.gguf"' in box.read_text()
    assert destination(load_config(box), inside) == (inside, "kept")


def test_a_model_folder_reached_through_a_symlink_is_written_as_the_config_names_it(tmp_path: Path,
                                                                                    tiny_model: Path) -> None:
    (tmp_path / "disk" / "models").mkdir(parents=True)
    (tmp_path / "models").symlink_to(tmp_path / "disk" / "models")
    config = tmp_path / "appliance.yaml"
    config.write_text("model_dirs: [./models]\nmodels: []\n")
    added = add_model(config, tiny_model, name="t")
    assert added.path == tmp_path / "disk" / "models" / "tiny.gguf"
    assert "path: ./models/tiny.gguf" in config.read_text()
    assert load_config(config, check_files=True).model("t").path == tmp_path / "models" / "tiny.gguf"


def test_a_hard_linked_file_others_cannot_read_gets_a_note(box: Path) -> None:
    source = box.parent / "downloads" / "Tiny Chat.gguf"
    source.chmod(0o600)
    added = add_model(box, source, name="private")
    assert len(added.notes) == 1 and "not readable by other users (mode 0600" in added.notes[0]


@pytest.mark.parametrize(("make", "code", "words"), [
    (lambda folder: folder / "nothing.gguf", "BAD_REQUEST", "no such file"),
    (lambda folder: folder, "BAD_REQUEST", "is not a regular file"),
    (lambda folder: _fifo(folder / "pipe.gguf"), "BAD_REQUEST", "is not a regular file"),
    (lambda folder: _write(folder / "notes.gguf", b"not a model"), "MODEL_LOAD_FAILED", "is not a GGUF file"),
    (lambda folder: _write(folder / "cut.gguf", (folder / "Tiny Chat.gguf").read_bytes()[:4096]),
     "MODEL_LOAD_FAILED", ""),
])
def test_a_bad_file_is_refused_and_nothing_changes(box: Path, make, code: str, words: str) -> None:  # type: ignore[no-untyped-def]
    before = box.read_bytes()
    placed = sorted((box.parent / "state" / "models").iterdir())
    with pytest.raises(ApplianceError) as info:
        add_model(box, make(box.parent / "downloads"), name="bad")
    assert info.value.code == code and words in info.value.message
    assert box.read_bytes() == before and sorted((box.parent / "state" / "models").iterdir()) == placed


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("name", "code"), [("demo", "MODEL_EXISTS"), ("gpt-4.1", "MODEL_EXISTS"),
                                            ("has space", "BAD_REQUEST")])
def test_a_name_in_use_or_not_a_name_is_refused(box: Path, name: str, code: str) -> None:
    before = box.read_bytes()
    with pytest.raises(ApplianceError) as info:
        add_model(box, box.parent / "downloads" / "Tiny Chat.gguf", name=name)
    assert info.value.code == code
    assert box.read_bytes() == before and not (box.parent / "state" / "models" / "Tiny Chat.gguf").exists()


def test_another_file_of_the_same_name_in_the_folder_is_refused(box: Path, tiny_model_b: Path) -> None:
    shutil.copy(tiny_model_b, box.parent / "state" / "models" / "Tiny Chat.gguf")
    with pytest.raises(ApplianceError) as info:
        add_model(box, box.parent / "downloads" / "Tiny Chat.gguf")
    assert info.value.code == "BAD_REQUEST" and "is already there and is another file" in info.value.message


def test_a_hard_linked_config_is_refused_before_anything_is_placed(box: Path) -> None:
    os.link(box, box.parent / "other-name.yaml")
    with pytest.raises(ApplianceError) as info:
        add_model(box, box.parent / "downloads" / "Tiny Chat.gguf")
    assert info.value.code == "FORBIDDEN" and "has 2 hard links" in info.value.message
    assert "sudo" not in info.value.message  # root would not help
    assert not (box.parent / "state" / "models" / "Tiny Chat.gguf").exists()


@pytest.fixture
def shared_folder(tiny_model: Path) -> Iterator[Path]:
    """A folder other users may enter (pytest's own temporary folders are private), with a config and a model."""
    folder = Path(tempfile.mkdtemp(prefix="ap-add-"))
    folder.chmod(0o755)
    (folder / "models").mkdir()
    shutil.copy(tiny_model, folder / "t.gguf")
    (folder / "t.gguf").chmod(0o644)
    (folder / "appliance.yaml").write_text("model_dirs: [./models]\nmodels: []\n")
    (folder / "appliance.yaml").chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


NOBODY = 65534


def test_a_config_this_user_may_not_write_is_refused_with_the_sudo_command(shared_folder: Path) -> None:
    config = shared_folder / "appliance.yaml"
    before = config.read_bytes()
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to run the command as another user")
        done = appliance("models", "add", str(shared_folder / "t.gguf"), "--config", str(config), user=NOBODY)
    else:
        config.chmod(0o444)
        shared_folder.chmod(0o555)
        try:
            done = appliance("models", "add", str(shared_folder / "t.gguf"), "--config", str(config))
        finally:
            shared_folder.chmod(0o755)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"appliance: FORBIDDEN: cannot add the model: {config} is not writable by this process")
    assert last.endswith(f"add it as root: sudo {sys.executable.rsplit('/', 1)[0]}/appliance models add "
                         f"{shared_folder / 't.gguf'} --name t --config {config}")
    assert config.read_bytes() == before and not list((shared_folder / "models").iterdir())


def test_a_file_this_user_cannot_read_is_refused(shared_folder: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to make a file another user cannot read) and setpriv")
    (shared_folder / "t.gguf").chmod(0o600)
    (shared_folder / "appliance.yaml").chmod(0o666)
    done = appliance("models", "add", str(shared_folder / "t.gguf"), "--config",
                     str(shared_folder / "appliance.yaml"), user=NOBODY)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"appliance: FORBIDDEN: cannot read {shared_folder / 't.gguf'}: "
                                                    f"permission denied (user id {NOBODY})")


def test_a_read_only_file_system_is_refused_clearly(shared_folder: Path) -> None:
    """As root, a read-only bind mount of the config's folder (in a mount namespace of its own): the file system is
    named, and no sudo command is offered (root would not help)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a read-only bind mount")
    config = shared_folder / "etc" / "appliance.yaml"
    config.parent.mkdir()
    config.write_text(f"model_dirs: [{shared_folder / 'models'}]\n")
    script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" "$1" && shift && exec "$@"'
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                           str(config.parent), sys.executable, "-m", "appliance", "models", "add",
                           str(shared_folder / "t.gguf"), "--config", str(config)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    if "mount" in done.stderr and "appliance:" not in done.stderr:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (f"appliance: FORBIDDEN: cannot add the model: {config} is not "
                                                    f"writable by this process (a read-only file system)")
    assert not list((shared_folder / "models").iterdir())


# --- a running appliance picks it up --------------------------------------------------------------------------------


def test_the_running_appliance_serves_the_added_model_after_its_reload(tmp_path: Path, tiny_model: Path,
                                                                       tiny_model_b: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "a.gguf")
    shutil.copy(tiny_model_b, tmp_path / "new.gguf")
    with running({"a": {"path": str(folder / "a.gguf"), "n_ctx": 256}}, model_dirs=[folder], watch=True) as app:
        url = f"{app.appliance.http_url}/v1/models"
        assert [m["id"] for m in httpx.get(url, timeout=10).json()["data"]] == ["a"]
        done = appliance("models", "add", str(tmp_path / "new.gguf"), "--n-ctx", "256", "--config",
                         str(app.config_file))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"added model new: {folder / 'new.gguf'} (linked) to {app.config_file}")
        deadline = time.monotonic() + 15  # the watcher sees the rename within a second; the reload then applies
        while "new" not in [m["id"] for m in httpx.get(url, timeout=10).json()["data"]]:
            assert time.monotonic() < deadline, app.appliance.reload_history()
            time.sleep(0.1)
        assert "model name=new" in app.line("LIST")
        assert app.line("REGISTER x new").startswith("OK")
        assert "OK prompt_tokens=" in app.line("DECODE x 4 Hello")
        assert app.appliance.reload_history()[-1]["trigger"] == "file"

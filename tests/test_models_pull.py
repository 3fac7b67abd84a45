"""``appliance models pull``: a real ``huggingface_hub`` download from a hub the test serves itself
(``HF_ENDPOINT``, tests/hub.py), into the first model folder, its checksum verified, then added; a dropped download
resumes, a corrupt one is refused, a box without network gets one line."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hub import Hub, closed_port, entry, serving
from huggingface_hub.hf_api import RepoFile

from appliance.config.validate import load_config
from appliance.errors import ApplianceError
from appliance.models.pull import checksum_of, file_checksum, pick_file

ROOT = Path(__file__).resolve().parents[1]
REPO = "acme/Tiny-GGUF"
CONFIG = 'data_dir: ./state\nmodel_dirs: ["{data_dir}/models"]\nmodels: []  # none yet\n'


@pytest.fixture
def box(tmp_path: Path) -> Path:
    config = tmp_path / "appliance.yaml"
    config.write_text(CONFIG)
    return config


def pull(hub_url: str, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HOME": str(config.parent / "hf-home"),
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_TOKEN", None)
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "appliance", "models", "pull", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)


# --- pure ---------------------------------------------------------------------------------------------------------


def test_the_file_is_the_only_gguf_or_the_one_named() -> None:
    assert pick_file(REPO, ["README.md", "tiny.gguf"], None) == "tiny.gguf"
    assert pick_file(REPO, ["a.gguf", "b.gguf"], "b.gguf") == "b.gguf"
    with pytest.raises(ApplianceError) as several:
        pick_file(REPO, ["q8/b.gguf", "README.md", "a.GGUF"], None)
    assert several.value.code == "BAD_REQUEST" and several.value.details["files"] == ["a.GGUF", "q8/b.gguf"]
    assert several.value.message == f"{REPO} has 2 .gguf files; name one: a.GGUF, q8/b.gguf"
    with pytest.raises(ApplianceError) as none:
        pick_file(REPO, ["README.md"], None)
    assert none.value.message == f"{REPO} has no .gguf file"


def test_a_file_is_hashed_as_the_hub_hashes_it(tmp_path: Path, tiny_model: Path) -> None:
    assert file_checksum(tiny_model, "sha256") == hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    blob = subprocess.run(["git", "hash-object", str(tiny_model)], capture_output=True, text=True, check=True)
    assert file_checksum(tiny_model, "git-sha1") == blob.stdout.strip()


# --- pulls from a hub of the test's own ------------------------------------------------------------------------------


def test_a_pull_downloads_verifies_and_adds_the_model(box: Path, tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    with serving(Hub({REPO: {"tiny.gguf": data, "README.md": b"# tiny\n"}})) as hub:
        done = pull(hub.url, box, REPO, "--n-ctx", "256")
    assert done.returncode == 0, done.stderr
    digest = hashlib.sha256(data).hexdigest()
    placed = box.parent / "state" / "models" / "tiny.gguf"
    assert done.stdout.splitlines()[0] == f"pulled tiny.gguf from {REPO}: sha256 {digest} verified"
    assert f"added model tiny: {placed} (kept) to {box}" in done.stdout
    assert placed.read_bytes() == data
    config = load_config(box, check_files=True)
    assert config.model("tiny").path == placed and config.model("tiny").n_ctx == 256
    assert box.read_text().startswith("data_dir: ./state\n") and "# none yet" in box.read_text()
    routes = {(method, route) for method, path, _ in hub.requests
              for route in ("tree", "paths-info", "resolve") if f"/{route}/" in path}
    assert routes == {("GET", "tree"), ("POST", "paths-info"), ("HEAD", "resolve"), ("GET", "resolve")}


@pytest.fixture(scope="module")
def large_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 28 MB model: huggingface_hub writes a download in 10 MiB chunks, so half of it is more than one chunk."""
    from appliance.engine.tinymodel import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("large") / "large.gguf", layers=4, dim=512, seed=3)


def test_a_dropped_download_resumes_where_it_stopped(box: Path, large_model: Path) -> None:
    data = large_model.read_bytes()
    with serving(Hub({REPO: {"large.gguf": data}}, cut_first=True)) as hub:
        done = pull(hub.url, box, REPO, "large.gguf", "--name", "resumed")
    assert done.returncode == 0, done.stderr
    first, second = hub.gets("large.gguf")
    assert "range" not in {key.lower() for key in first}
    resumed_at = int(second["Range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= len(data) // 2  # what it had written was not fetched again
    assert "Trying to resume download" in done.stderr
    assert (box.parent / "state" / "models" / "large.gguf").read_bytes() == data
    assert load_config(box).model("resumed") is not None


def test_a_download_that_does_not_match_its_checksum_is_removed_and_nothing_added(box: Path,
                                                                                  tiny_model: Path) -> None:
    data = tiny_model.read_bytes()
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    with serving(Hub({REPO: {"tiny.gguf": data}}, served={"tiny.gguf": bytes(corrupt)})) as hub:
        done = pull(hub.url, box, REPO)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"appliance: MODEL_LOAD_FAILED: tiny.gguf from {REPO} does not match its sha256 checksum "
                           f"(expected {hashlib.sha256(data).hexdigest()}, got "
                           f"{hashlib.sha256(bytes(corrupt)).hexdigest()}): removed, nothing added")
    assert box.read_text() == CONFIG
    assert not (box.parent / "state" / "models" / "tiny.gguf").exists()


def test_several_gguf_files_need_one_named(box: Path, tiny_model: Path, tiny_model_b: Path) -> None:
    files = {"q4/a.gguf": tiny_model.read_bytes(), "q8/b.gguf": tiny_model_b.read_bytes()}
    with serving(Hub({REPO: files})) as hub:
        refused = pull(hub.url, box, REPO)
        assert refused.returncode == 1
        assert refused.stderr.strip().splitlines()[-1] == (f"appliance: BAD_REQUEST: {REPO} has 2 .gguf files; "
                                                           f"name one: q4/a.gguf, q8/b.gguf")
        assert box.read_text() == CONFIG
        done = pull(hub.url, box, REPO, "q8/b.gguf")
    assert done.returncode == 0, done.stderr
    assert 'path: "{data_dir}/models/q8/b.gguf"' in box.read_text()
    assert load_config(box, check_files=True).model("b") is not None


def test_a_repository_or_file_the_hub_does_not_have_is_named(box: Path, tiny_model: Path) -> None:
    with serving(Hub({REPO: {"tiny.gguf": tiny_model.read_bytes()}})) as hub:
        no_repo = pull(hub.url, box, "acme/nothing")
        no_file = pull(hub.url, box, REPO, "other.gguf")
    assert no_repo.returncode == 1 and no_repo.stderr.strip().splitlines()[-1].startswith(
        "appliance: UNKNOWN_MODEL: no repository acme/nothing on http://127.0.0.1:")
    assert no_file.returncode == 1 and no_file.stderr.strip().splitlines()[-1] == (
        f"appliance: UNKNOWN_MODEL: {REPO} has no file other.gguf")
    assert box.read_text() == CONFIG


def test_a_box_without_network_gets_one_line(box: Path) -> None:
    port = closed_port()
    for args in ([REPO], [REPO, "tiny.gguf"]):
        done = pull(f"http://127.0.0.1:{port}", box, *args)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith(f"appliance: HUB_UNAVAILABLE: cannot reach http://127.0.0.1:{port} (no network, "
                                   f"or HF_ENDPOINT is wrong): ")
    assert box.read_text() == CONFIG


def test_the_hub_reports_an_lfs_sha256_for_a_gguf(tiny_model: Path) -> None:
    """What the pull compares against: the paths-info entry's LFS sha256 (its git blob id for a file without LFS)."""
    data = tiny_model.read_bytes()
    lfs = checksum_of(RepoFile(**entry("tiny.gguf", data)))
    assert (lfs.kind, lfs.value, lfs.size) == ("sha256", hashlib.sha256(data).hexdigest(), len(data))
    plain = {key: value for key, value in entry("README.md", b"# tiny\n").items() if key != "lfs"}
    blob = checksum_of(RepoFile(**plain))
    assert blob.kind == "git-sha1" and blob.value == plain["oid"]


def test_a_config_this_user_may_not_write_is_refused_before_any_download() -> None:
    """As another user (root runs the command as nobody): the sudo command to run, and no request to the hub."""
    folder = Path(tempfile.mkdtemp(prefix="ap-pull-"))
    try:
        folder.chmod(0o755)
        config = folder / "appliance.yaml"
        config.write_text(CONFIG)
        config.chmod(0o644)
        command = [sys.executable, "-m", "appliance", "models", "pull", REPO, "--config", str(config)]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("needs setpriv to run the command as another user")
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
        else:
            folder.chmod(0o555)
        with serving(Hub({REPO: {}})) as hub:
            env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(folder / "hf-home")}
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"appliance: FORBIDDEN: cannot add the model: {config} is not writable by this "
                               f"process")
        assert last.endswith(f"add it as root: sudo {sys.executable.rsplit('/', 1)[0]}/appliance models pull {REPO} "
                             f"--config {config}")
        assert hub.requests == [] and config.read_text() == CONFIG
    finally:
        folder.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)

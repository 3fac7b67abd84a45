"""Bad model files: REGISTER of a crafted GGUF inside ``model_dirs`` is refused with ``MODEL_LOAD_FAILED`` while the
neighbour keeps decoding, the ledger is unchanged and the daemon keeps serving.

Most files are refused by the bounded GGUF reader in milliseconds; a vocabulary with a duplicate entry passes it and
makes llama.cpp abort (SIGABRT), which only the trial load in a child process catches.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from crafted import write_llama

from appliance.engine import modelcheck


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("crafted-models")
    files = {
        "blocks": write_llama(folder / "blocks.gguf", claims={"block_count": 1000}),
        "more_blocks_than_tensors": write_llama(folder / "more_blocks_than_tensors.gguf", claims={"block_count": 40}),
        "experts": write_llama(folder / "experts.gguf", claims={"expert_count": 4, "expert_used_count": 1000}),
        "no_used_expert": write_llama(folder / "no_used_expert.gguf", claims={"expert_count": 1,
                                                                               "expert_used_count": 0}),
        "huge_context": write_llama(folder / "huge_context.gguf", claims={"context_length": 2**32 - 1}),
        "gqa": write_llama(folder / "gqa.gguf", claims={"attention.head_count_kv": 3}),
        "duplicate_token": write_llama(folder / "duplicate_token.gguf", duplicate_token=True),
        "two_million": write_llama(folder / "two_million.gguf", junk_strings=2_000_000),
    }
    junk = folder / "junk.gguf"
    junk.write_bytes(b"GGUF" + np.random.default_rng(8).bytes(8192))
    files["junk"] = junk
    truncated = folder / "truncated.gguf"
    truncated.write_bytes(files["duplicate_token"].read_bytes()[:50_000])
    files["truncated"] = truncated
    return files


def place(hostile, source: Path) -> Path:  # type: ignore[no-untyped-def]
    target = hostile.model_dir / source.name
    shutil.copyfile(source, target)
    return target


def register_refused(hostile, agent: str, path: Path) -> str:  # type: ignore[no-untyped-def]
    """REGISTER the file; the answer must be ERR MODEL_LOAD_FAILED, and nothing reserved or registered."""
    daemon = hostile.app.daemon
    served = hostile.neighbour.served
    reply = hostile.app.line(f"REGISTER {agent} {path}", timeout=60)
    assert reply.startswith("ERR MODEL_LOAD_FAILED"), reply
    assert "Traceback" not in reply and len(reply) < 2000
    # Nothing of the refused file is reserved (the neighbour's model may resize its own context meanwhile).
    assert not [key for key in daemon.ledger.reservations() if key.startswith(str(path))], daemon.ledger.reservations()
    assert agent not in daemon.agents
    assert all(m.state in ("available", "loaded") for m in daemon.models.values())
    assert hostile.neighbour_served_since(served), "the neighbour was not served after the refusal"
    return reply


def test_files_with_hostile_metadata_are_refused_by_the_reader(hostile, crafted) -> None:  # type: ignore[no-untyped-def]
    trials = modelcheck.stats["trials"]
    reasons = {  # the line protocol's ERR carries the details: the rule broken and its limit
        "blocks": "key=llama.block_count rule=limit limit=512 found=1000",
        "more_blocks_than_tensors": "key=llama.block_count rule=consistency found=40 missing_block=2",
        "experts": "key=llama.expert_used_count rule=limit limit=512 found=1000",
        "no_used_expert": "key=llama.expert_used_count rule=consistency limit=1 found=0",
        "huge_context": "key=llama.context_length rule=limit limit=16777216 found=4294967295",
        "gqa": "key=llama.attention.head_count_kv rule=consistency",
        "junk": "rule=version",
        "truncated": "rule=truncated",
    }
    for n, (name, words) in enumerate(reasons.items()):
        reply = register_refused(hostile, f"bad{n}", place(hostile, crafted[name]))
        assert words in reply, reply
    assert modelcheck.stats["trials"] == trials, "the reader should refuse these without starting a child"
    assert hostile.app.line("REGISTER fine demo-b").startswith("OK")


def test_a_two_million_entry_metadata_array_is_refused_fast(hostile, crafted) -> None:  # type: ignore[no-untyped-def]
    """It took 55 s to REGISTER and slowed others' decodes; now the count alone is refused."""
    path = place(hostile, crafted["two_million"])
    start = time.perf_counter()
    reply = register_refused(hostile, "big", path)
    assert time.perf_counter() - start < 5
    assert "key=general.junk rule=array_entries limit=1048576 found=2000000" in reply


def test_a_file_that_aborts_llama_cpp_is_caught_by_the_trial_load(hostile, crafted) -> None:  # type: ignore[no-untyped-def]
    """The reader finds nothing wrong; llama.cpp would abort the daemon. The child dies instead."""
    path = place(hostile, crafted["duplicate_token"])
    reply = register_refused(hostile, "dup", path)
    assert "check=trial_load signal=SIGABRT" in reply and "GGML_ASSERT" in reply
    trials = modelcheck.stats["trials"]
    for n in range(5):  # a client insisting gets the cached verdict: no more children
        assert "SIGABRT" in register_refused(hostile, f"dup{n}", path)
    assert modelcheck.stats["trials"] == trials
    assert hostile.app.line("REGISTER after demo-b").startswith("OK")

"""Quantized weights (a Q4_0 copy of the real tiny model, quantized by llama.cpp itself) load and decode in a batch:
llama.cpp's CPU "extra" buffer types (repacked layouts, AMX) stay off (``appliance.engine.batched.EXTRA_BUFFERS``),
in the daemon's loads and in the model check's trial load alike. With them on, a CPU that reports AMX crashed
llama.cpp on a quantized model's first batched decode (SIGSEGV), and the model check refused every quantized file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.engine import llamalog, modelcheck
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.bindings import llama_cpp
from appliance.engine.interface import Sampling

GREEDY = Sampling(temperature=0.0)
Q4_0 = 2  # LLAMA_FTYPE_MOSTLY_Q4_0
EXTRA_BUFFER = re.compile(r"(REPACK|AMX|EXTRA)[A-Za-z_]* model buffer size", re.I)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from appliance.engine.tinymodel import write_tiny_model

    folder = tmp_path_factory.mktemp("quantized")
    source = folder / "tiny-f16.gguf"
    write_tiny_model(source, layers=4, dim=256, seed=3)
    target = folder / "tiny-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = Q4_0
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    return target


def test_quantized_weights_stay_in_the_plain_cpu_buffer(quantized: Path) -> None:
    with llamalog.llama_log_lines() as lines:
        weights = ModelWeights(quantized)
    try:
        logged = "".join(lines)
        assert "model buffer size" in logged  # the capture saw the load
        assert not EXTRA_BUFFER.search(logged), logged
    finally:
        weights.close()


def test_a_quantized_model_decodes_a_batch_of_sequences(quantized: Path) -> None:
    weights = ModelWeights(quantized)
    try:
        context = BatchedContext(weights, n_ctx=512, n_seq_max=4, n_batch=512, n_ubatch=512, n_threads=2)
        try:
            prompt = weights.tokenize("Once upon a time there was a little fox who lived in the woods", bos=True)
            for seq_id in range(4):
                context.add(seq_id, prompt, GREEDY, 8)
            events = []
            while context.has_work():
                events += context.step()
            texts = {seq_id: b"".join(e.piece for e in events if e.seq_id == seq_id) for seq_id in range(4)}
            assert sum(1 for e in events if e.done) == 4
            assert len(set(texts.values())) == 1  # greedy: the same prompt, the same text in every sequence
        finally:
            context.close()
    finally:
        weights.close()


def test_the_model_check_passes_a_quantized_file(quantized: Path) -> None:
    verdict = modelcheck.check_model(quantized, n_ctx=256, n_gpu_layers=0)
    assert verdict.ok, verdict.reason

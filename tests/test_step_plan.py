"""The step plan (docs/design.md 3.5): `build_metadata` checks every index once per step on the
host, and every layer's ops then skip their value checks, which on an NPU are device-to-host
copies.

The NPU side runs here through the emulated Ascend launchers (tests/ascend_emu.py), which count
every device-to-host copy the shared host code makes (`transfers`)."""

import pytest
import torch

from dflash import LLM, SamplingParams
from dflash.models.layers import build_metadata

from ascend_emu import Emulated
from ascend_emu import ops as emu_ops
from helpers import CharTokenizer, make_tiny_pair

B = 4
PROMPTS = [[(5 * i + 3 * j) % 90 + 1 for j in range(n)] for i, n in enumerate([6, 11, 3, 9])]


def test_plan_is_built_on_the_host_and_checked():
    meta = build_metadata([[3, 1], [0]], [5, 0], [2, 3], 4, num_blocks=4)
    assert meta.checked
    assert meta.positions.tolist() == [5, 6, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 0, 1, 2]
    assert meta.block_table.dtype == meta.context_lens.dtype == meta.cu_query_lens.dtype \
        == torch.int32
    assert meta.cu_query_lens.tolist() == [0, 2, 5] and meta.context_lens.tolist() == [5, 0]
    assert not build_metadata([[0]], [0], [1], 4).checked   # no block count: nothing to check


@pytest.mark.parametrize("tables, starts, lengths, message", [
    ([[3, 7]], [5], [2], r"block_tables\[0\]\[1\] = 7 is out of range for 4 cache blocks"),
    ([[0], [-1]], [0, 0], [1, 1], r"block_tables\[1\]\[0\] = -1 is out of range"),
    ([[0]], [3], [2], r"sequence 0 \(start 3, 2 new tokens\) .* 2 cache blocks; its block "
                      r"table has 1"),
    ([[0]], [-1], [1], r"sequence 0 \(start -1"),
    ([[0], [1]], [0], [1, 1], r"2 block tables, 1 starts and 2 lengths"),
])
def test_plan_rejects_bad_indices(tables, starts, lengths, message):
    with pytest.raises(ValueError, match=message):
        build_metadata(tables, starts, lengths, 4, num_blocks=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("plan"), B)[:2]


@pytest.fixture
def emulated_npu(monkeypatch):
    emu = emu_ops()
    yield Emulated(emu, monkeypatch)
    emu.configure(8, 0, 0)


def _params(i):
    # two greedy and two sampled requests: the sampled ones go through rejection_sample
    return SamplingParams(max_tokens=24) if i % 2 == 0 else \
        SamplingParams(max_tokens=24, temperature=0.7, seed=i)


def _decode(llm, emu, plan_checked=True):
    """Runs the prompts to completion; returns the outputs and the host copies each decode
    step made (the first step, which runs the prefill, is not counted)."""
    if not plan_checked:   # the ops check every call, as direct calls do
        llm.worker.num_kv_blocks = None
    engine = llm.engine
    ids = [engine.add_request(p, _params(i)) for i, p in enumerate(PROMPTS)]
    outputs, copies = {}, []
    first = True
    while engine.has_unfinished():
        before = emu.transfers()
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output.token_ids
        if not first:
            copies.append(emu.transfers() - before)
        first = False
    return [outputs[i] for i in ids], copies


def test_decode_steps_make_no_transfers(models, emulated_npu):
    llm = LLM(*models, dtype="float32", max_num_seqs=B, speculation="fixed",
              tokenizer=CharTokenizer())
    outputs, copies = _decode(llm, emulated_npu)
    assert len(copies) >= 5 and copies == [0] * len(copies)

    # The same requests with every op checking: its copies, per decode step, per layer.
    unchecked, copies_unchecked = _decode(llm, emulated_npu, plan_checked=False)
    assert unchecked == outputs   # same seeds, same tokens
    layers = llm.target.cfg.num_layers + llm.draft.cfg.num_layers
    # 3 per paged_attention call (cu_query_lens, context_lens, block_table), 2 per context_kv
    # call (positions, slots), 1 per qkv_rope_cache call (slots, in every target layer)
    assert copies_unchecked[0] == 3 * layers + 2 + llm.target.cfg.num_layers


def test_emulated_kernels_decode_what_the_cpu_kernels_decode(models, emulated_npu, monkeypatch):
    llm = LLM(*models, dtype="float32", max_num_seqs=B, speculation="fixed",
              tokenizer=CharTokenizer())
    greedy = SamplingParams(max_tokens=24)
    emulated = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == emulated

"""The run-time choice of paged attention backend on NPUs (dflash.ops.npu_attention).

No NPU here: the fused_infer path is exercised with a stand-in for torch_npu whose
`npu_fused_infer_attention_score` follows that op's documented semantics for the one call form
dflash makes (TND queries, paged K/V through a block table, per-sequence key counts, sparse_mode 0
without mask or 3 with the 2048 x 2048 upper-triangular mask). It checks dflash's side: the cache
writes, layouts, lengths and masks, against dflash.ops.reference. Whether the real op agrees with
its documentation can only be checked on an NPU.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dflash
from dflash.ops import npu_attention, reference
from dflash.ops.cases import paged_attention_inputs

ROOT = Path(__file__).resolve().parents[1]


class FakeTorchNpu:
    """npu_fused_infer_attention_score as documented, for the arguments dflash passes."""

    def __init__(self):
        self.calls = []

    def npu_fused_infer_attention_score(self, query, key, value, *, atten_mask, block_table,
                                        input_layout, block_size, actual_seq_lengths,
                                        actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                        scale, sparse_mode):
        self.calls.append(dict(sparse_mode=sparse_mode, seqs=len(actual_seq_lengths)))
        assert input_layout == "TND" and query.shape[1] == num_heads
        assert key.dim() == 3 and key.shape[1] == block_size and value.shape == key.shape
        if sparse_mode == 0:
            assert atten_mask is None
        else:
            assert sparse_mode == 3 and atten_mask.dtype == torch.bool
            assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        d = query.shape[2]
        group = num_heads // num_key_value_heads
        out = torch.empty_like(query)
        start = 0
        for b, (end, kv) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
            blocks = block_table[b, : -(-kv // block_size)].long()
            k = key[blocks].reshape(-1, num_key_value_heads, d)[:kv].float()
            v = value[blocks].reshape(-1, num_key_value_heads, d)[:kv].float()
            q = query[start:end].float()
            scores = torch.einsum("nhd,khd->hnk", q, k.repeat_interleave(group, 1)) * scale
            if sparse_mode == 3:  # query i of n sees the keys up to kv - n + i
                n = end - start
                hidden = torch.arange(kv)[None] > torch.arange(n)[:, None] + kv - n
                scores = scores.masked_fill(hidden, float("-inf"))
            probs = scores.softmax(-1)
            out[start:end] = torch.einsum("hnk,khd->nhd", probs,
                                          v.repeat_interleave(group, 1)).to(query.dtype)
            start = end
        return out, None


def fused(args, fake=None):
    return npu_attention.fused_infer_attention(fake or FakeTorchNpu(), **args)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_infer_matches_the_reference_and_writes_the_new_tokens(causal, dtype):
    # The engine's layout: each sequence owns blocks for its context and its new tokens.
    ctx, new = (5, 0, 16, 9), (3, 4, 0, 1)
    args = paged_attention_inputs(context_lens=[c + n for c, n in zip(ctx, new)], query_lens=new,
                                  hq=8, hkv=2, d=16, block_size=4, causal=causal, dtype=dtype,
                                  seed=1)
    args["context_lens"] = torch.tensor(ctx, dtype=torch.int32)
    table = args["block_table"]
    want = reference.paged_attention(**args)
    before = [args["key_cache"].clone(), args["value_cache"].clone()]
    fake = FakeTorchNpu()
    got = fused(args, fake)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert fake.calls == [dict(sparse_mode=3 if causal else 0, seqs=3)]  # empty sequence dropped

    expected = [c.clone() for c in before]
    cu, ctx = args["cu_query_lens"].tolist(), args["context_lens"].tolist()
    for b in range(4):
        for i, t in enumerate(range(cu[b], cu[b + 1])):
            pos = ctx[b] + i
            block, slot = int(table[b, pos // 4]), pos % 4
            expected[0][block, slot] = args["key"][t]
            expected[1][block, slot] = args["value"][t]
    assert torch.equal(args["key_cache"], expected[0])
    assert torch.equal(args["value_cache"], expected[1])


def test_fused_infer_rejects_what_it_cannot_serve_before_writing():
    args = paged_attention_inputs(context_lens=(3, 0, 9), query_lens=(2, 1, 4), block_size=4,
                                  dtype=torch.bfloat16)
    before = args["key_cache"].clone()
    with pytest.raises(ValueError, match="block_table row 2 covers 12 tokens, not 9 \\+ 4"):
        fused(args)
    args32 = paged_attention_inputs()
    with pytest.raises(ValueError, match="serves bfloat16 and float16, got torch.float32"):
        fused(args32)
    bad = paged_attention_inputs(context_lens=(3, 0, 9), query_lens=(2, 1, 4), block_size=8,
                                 dtype=torch.bfloat16)
    bad["block_table"][0, 0] = 99
    with pytest.raises(ValueError, match="block_table\\[0, 0\\] = 99 is out of range"):
        fused(bad)
    assert torch.equal(args["key_cache"], before)


def test_fused_infer_reads_index_values_for_checks_only_when_check_asks(monkeypatch):
    # check=False (the engine's decode path, its plan checked on the host) must not read the
    # index tensors back to validate them: on an NPU each read is a synchronisation. The lengths
    # the torch_npu op takes as host lists are the only reads left.
    ctx, new = (5, 16, 9), (3, 4, 1)
    args = paged_attention_inputs(context_lens=[c + n for c, n in zip(ctx, new)], query_lens=new,
                                  hq=8, hkv=2, d=16, block_size=4, dtype=torch.bfloat16, seed=2)
    args["context_lens"] = torch.tensor(ctx, dtype=torch.int32)
    want = reference.paged_attention(**args)   # before the reads are counted (and stubbed)
    read = []
    monkeypatch.setattr(npu_attention.checks, "paged_attention_values",
                        lambda *a, **k: read.append("values"))
    monkeypatch.setattr(torch.Tensor, "nonzero",
                        lambda self, *a, **k: read.append("nonzero") or torch.zeros(0, 1))
    torch.testing.assert_close(fused({**args, "check": False}), want, atol=2e-2, rtol=2e-2)
    assert read == []
    fused({**args, "check": True})
    assert read == ["values", "nonzero"]


def test_backend_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(npu_attention.ENV, raising=False)
    assert npu_attention.backend() == "dflash"
    monkeypatch.setenv(npu_attention.ENV, " Fused_Infer ")
    assert npu_attention.backend() == "fused_infer"
    monkeypatch.setenv(npu_attention.ENV, "flash")
    with pytest.raises(ValueError, match="choose one of dflash, fused_infer"):
        npu_attention.backend()


def test_cpu_tensors_ignore_the_choice_and_never_import_torch_npu(tmp_path):
    # A torch_npu that fails on import: neither `import dflash` nor a CPU call may touch it.
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise ImportError('imported torch_npu')\n")
    script = textwrap.dedent("""
        import sys, torch, dflash
        from dflash.ops import reference
        from dflash.ops.cases import paged_attention_inputs
        args = paged_attention_inputs(causal=True)
        torch.testing.assert_close(dflash.ops.paged_attention(**args),
                                   reference.paged_attention(**args))
        assert "torch_npu" not in sys.modules
    """)
    env = {**os.environ, npu_attention.ENV: "fused_infer",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_ops_wrapper_dispatches_through_the_backend_choice(monkeypatch):
    seen = []
    monkeypatch.setattr(npu_attention, "paged_attention",
                        lambda *a: seen.append(len(a)) or torch.zeros(1))
    dflash.ops.paged_attention(*paged_attention_inputs().values())
    assert seen == [13]   # every argument, check, tree_mask and out included

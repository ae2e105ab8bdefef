"""The op registry: schemas, fake tensors, clear errors for bad input in every implementation."""

import pytest
import torch

import dflash
from dflash.ops import reference
from dflash.ops.cases import context_kv_inputs, paged_attention_inputs, rejection_sample_inputs

import ascend_emu

OPS = {
    "context_kv": context_kv_inputs,
    "paged_attention": paged_attention_inputs,
    "rejection_sample": rejection_sample_inputs,
}
# Every implementation that serves an op must reject the same bad inputs with the same message.
# None: that implementation does not serve the op.
IMPLEMENTATIONS = {
    "reference": lambda op: getattr(reference, op),
    "torch.ops": lambda op: getattr(torch.ops.dflash, op),
    # the Ascend C kernels compiled for x86 against the emulation, behind their host launchers
    "ascend-emu": lambda op: getattr(ascend_emu.ops(), op),
}


def test_schemas_match_spec():
    schemas = {op: str(getattr(torch.ops.dflash, op).default._schema) for op in OPS}
    assert schemas["context_kv"].endswith(
        "Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, float eps, bool check=True) -> ()")
    assert schemas["paged_attention"].endswith(
        "float scale, bool causal, bool check=True, Tensor? tree_mask=None) -> Tensor")
    assert "Tensor? draft_probs" in schemas["rejection_sample"]
    assert schemas["rejection_sample"].endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("op, variant", [
    ("context_kv", {}), ("context_kv", {"dtype": torch.bfloat16, "with_bias": True}),
    ("paged_attention", {"causal": True}), ("paged_attention", {"dtype": torch.bfloat16}),
    ("rejection_sample", {"dense": True}), ("rejection_sample", {"dense": False}),
])
def test_opcheck(op, variant):
    torch.library.opcheck(getattr(torch.ops.dflash, op).default, (), OPS[op](**variant))


def test_fake_tensors_trace_through_torch_compile():
    args = paged_attention_inputs()

    @torch.compile(backend="eager", fullgraph=True)
    def attend(q, k, v):
        return torch.ops.dflash.paged_attention(q, k, v, *list(args.values())[3:])

    out = attend(args["query"], args["key"], args["value"])
    torch.testing.assert_close(out, reference.paged_attention(**args))


def _bad_context_kv():
    def case(pattern, **change):
        return pattern, change
    k = context_kv_inputs()
    return [
        case("hidden must be 2-D", hidden=k["hidden"][None]),
        case("fc_weight has shape", fc_weight=k["fc_weight"][:, :-1]),
        case("kv_weight has shape", kv_weight=k["kv_weight"][:-1]),
        case("expected 2 key and value caches", key_caches=k["key_caches"][:1],
             value_caches=k["value_caches"][:1]),
        case("value_caches\\[1\\] has shape", value_caches=[k["value_caches"][0],
                                                           k["value_caches"][1][:, :2]]),
        case("kv_weight has dtype", kv_weight=k["kv_weight"].half()),
        case("slot_mapping has dtype", slot_mapping=k["slot_mapping"].int()),
        case("slot_mapping\\[2\\] = 24 is out of range",
             slot_mapping=k["slot_mapping"].index_fill(0, torch.tensor([2]), 24)),
        case("slot_mapping\\[0\\] = -2 is out of range",
             slot_mapping=k["slot_mapping"].index_fill(0, torch.tensor([0]), -2)),
        case("positions\\[1\\] = 64 is out of range",
             positions=k["positions"].index_fill(0, torch.tensor([1]), 64)),
        case("cos_sin_cache has dtype", cos_sin_cache=k["cos_sin_cache"].double()),
        case("kv_bias has shape", kv_bias=torch.zeros(7)),
    ]


def _bad_paged_attention():
    def case(pattern, **change):
        return pattern, change
    a = paged_attention_inputs()
    bt = a["block_table"].clone()
    bt[2, 1] = 99
    neg = a["block_table"].clone()
    neg[0, 0] = -1
    return [
        case("query must be 3-D", query=a["query"][0]),
        case("query heads 4 must be a multiple of kv heads 3",
             key=torch.zeros(7, 3, 8), value=torch.zeros(7, 3, 8)),
        case("key has dtype", key=a["key"].half()),
        case("key_cache has shape", key_cache=a["key_cache"][..., :4]),
        case("block_table has dtype", block_table=a["block_table"].long()),
        case("block_table\\[2, 1\\] = 99 is out of range", block_table=bt),
        case("block_table\\[0, 0\\] = -1 is out of range", block_table=neg),
        case("context_lens\\[2\\] = 13 is out of range",
             context_lens=torch.tensor([3, 0, 13], dtype=torch.int32)),
        case("cu_query_lens is not monotone",
             cu_query_lens=torch.tensor([0, 4, 3, 7], dtype=torch.int32)),
        case("cu_query_lens must end at the 7 query rows",
             cu_query_lens=torch.tensor([0, 2, 3, 6], dtype=torch.int32)),
        case("cu_query_lens has shape", cu_query_lens=torch.tensor([0, 7], dtype=torch.int32)),
    ]


def _bad_rejection_sample():
    def case(pattern, **change):
        return pattern, change
    r = rejection_sample_inputs()
    nan = r["target_probs"].clone()
    nan[2, 1, 3] = float("nan")
    inf = r["draft_probs"].clone()
    inf[1, 0, 0] = float("inf")
    negative = r["target_probs"].clone()
    negative[3, 3, 5] = -0.1
    ids = r["draft_token_ids"].clone()
    ids[1, 2] = 11
    return [
        case("target_probs row \\(sequence 2, position 1\\) has NaN/Inf", target_probs=nan),
        case("draft_probs row \\(sequence 1, position 0\\) has NaN/Inf", draft_probs=inf),
        case("target_probs row \\(sequence 3, position 3\\) has negative", target_probs=negative),
        case("draft_token_ids\\[1, 2\\] = 11 is outside the vocabulary of 11",
             draft_token_ids=ids),
        case("target_probs has dtype", target_probs=r["target_probs"].double()),
        case("target_probs has shape", target_probs=r["target_probs"][:, :3]),
        case("draft_probs has shape", draft_probs=r["draft_probs"][..., :5]),
        case("is_greedy has dtype", is_greedy=r["is_greedy"].int()),
        case("uniform\\[0, 1\\] = 1 is outside",
             uniform=r["uniform"].index_fill(1, torch.tensor([1]), 1.0)),
        case("exponential row 0 must be positive", exponential=r["exponential"] * 0),
    ]


BAD = {"context_kv": _bad_context_kv, "paged_attention": _bad_paged_attention,
       "rejection_sample": _bad_rejection_sample}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", OPS)
def test_bad_input_raises_clear_error(op, impl):
    fn = IMPLEMENTATIONS[impl](op)
    if fn is None:
        pytest.skip(f"{impl} does not implement {op}")
    for pattern, change in BAD[op]():
        args = {**OPS[op](), **change}
        caches = [c.clone() for c in args.get("key_caches", []) + args.get("value_caches", [])]
        with pytest.raises(ValueError, match=f"^{op}: .*{pattern}"):
            fn(**args)
        after = args.get("key_caches", []) + args.get("value_caches", [])
        for before, now in zip(caches, after):   # the checks run before any write
            assert torch.equal(before.nan_to_num(7.0), now.nan_to_num(7.0))


def test_implementation_report(monkeypatch):
    from dflash.ops import registry

    # the test build compiles every CPU kernel: each op reports the loaded capability's kernel
    assert registry.CPU_CAPABILITY in ("AVX512", "AVX2", "DEFAULT")
    for op in registry.OPS:
        assert dflash.ops.implementation(op) == f"kernel ({registry.CPU_CAPABILITY})", op
    monkeypatch.setattr(registry, "has_kernel", lambda op: False)
    assert dflash.ops.implementation("rejection_sample") == "reference"
    with pytest.raises(ValueError, match="unknown dflash op"):
        dflash.ops.implementation("matmul")


def test_selfcheck_runs_every_op_against_the_reference(capsys):
    from dflash.ops import registry, selfcheck

    assert selfcheck.run()
    lines = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in lines} == set(registry.OPS)

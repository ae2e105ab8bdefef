"""`paged_attention.out` and `rejection_sample.out`: the ops into caller-owned outputs
(returning nothing, so that torch.compile functionalizes them) in every implementation, and the
capture contract the emulated Ascend launchers enforce (docs/design.md 3): while capturing, a
call that would copy between host and device or allocate its outputs raises; `.out` with
check=False does neither."""

import pytest
import torch

from dflash import ops
from dflash.ops import reference
from dflash.ops.cases import paged_attention_inputs, rejection_sample_inputs, tree_mask

import ascend_emu

CASES = {
    "causal": dict(causal=True),
    "draft block, bf16": dict(dtype=torch.bfloat16),
    "tree": dict(causal=True, context_lens=(3, 5), query_lens=(3, 4)),
}


def _inputs(case):
    args = paged_attention_inputs(**CASES[case])
    if case == "tree":
        args["tree_mask"] = tree_mask([[-1, 0, 0], [-1, 0, 1, 1]])
    return args


IMPLEMENTATIONS = {
    "torch.ops (CPU kernel)": lambda: (torch.ops.dflash.paged_attention.default,
                                       torch.ops.dflash.paged_attention.out),
    "reference": lambda: (reference.paged_attention, reference.paged_attention_out),
    "ascend-emu": lambda: (ascend_emu.ops().paged_attention.default,
                           ascend_emu.ops().paged_attention.out),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_out_holds_what_the_op_returns(impl, case):
    functional, into = IMPLEMENTATIONS[impl]()
    args = _inputs(case)
    out = torch.full_like(args["query"], float("nan"))
    assert into(**args, out=out) is None   # the schema returns nothing: torch.compile traces it
    assert torch.equal(out, functional(**args))


def test_the_python_api_and_opcheck():
    args = _inputs("causal")
    out = torch.empty_like(args["query"])
    assert ops.paged_attention(**args, out=out) is out
    assert torch.equal(out, ops.paged_attention(**args))
    torch.library.opcheck(torch.ops.dflash.paged_attention.out, (), {**args, "out": out})


BAD_OUT = [
    (lambda q: q.new_empty(q.shape[0] + 1, *q.shape[1:]), "out has shape \\[8, 4, 8\\], "
                                                          "expected size 7 in dim 0"),
    (lambda q: q.double(), "out has dtype torch.float64, expected torch.float32"),
    (lambda q: q.new_empty(q.shape[0], q.shape[2], q.shape[1]).transpose(1, 2),
     "out must be contiguous"),
]


@pytest.mark.parametrize("impl", [*IMPLEMENTATIONS, "fake"])
@pytest.mark.parametrize("bad, message", BAD_OUT)
def test_a_bad_out_is_named(impl, bad, message):
    args = _inputs("causal")
    if impl == "fake":
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                    for k, v in args.items()}
            into = torch.ops.dflash.paged_attention.out
            with pytest.raises(ValueError, match=f"paged_attention: {message}"):
                into(**args, out=bad(args["query"]))
        return
    into = IMPLEMENTATIONS[impl]()[1]
    with pytest.raises(ValueError, match=f"paged_attention: {message}"):
        into(**args, out=bad(args["query"]))


SAMPLERS = {
    "torch.ops (CPU kernel)": lambda: (torch.ops.dflash.rejection_sample.default,
                                       torch.ops.dflash.rejection_sample.out),
    "reference": lambda: (reference.rejection_sample, reference.rejection_sample_out),
    "ascend-emu": lambda: (ascend_emu.ops().rejection_sample.default,
                           ascend_emu.ops().rejection_sample.out),
}


def _sampler_outputs(args):
    bs, k = args["draft_token_ids"].shape
    return torch.full((bs, k + 1), -7, dtype=torch.int64), torch.full((bs,), -7)


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("impl", SAMPLERS)
def test_rejection_sample_out_holds_what_the_op_returns(impl, dense):
    functional, into = SAMPLERS[impl]()
    args = rejection_sample_inputs(dense=dense)
    ids, n = _sampler_outputs(args)
    assert into(**args, output_token_ids=ids, num_accepted=n) is None
    want_ids, want_n = functional(**args)
    assert torch.equal(ids, want_ids) and torch.equal(n, want_n)
    ids2, n2 = _sampler_outputs(args)
    got = ops.rejection_sample(**args, out=(ids2, n2))
    assert got[0] is ids2 and got[1] is n2
    assert torch.equal(ids2, want_ids) and torch.equal(n2, want_n)
    if impl == "torch.ops (CPU kernel)":
        torch.library.opcheck(into, (), {**args, "output_token_ids": ids,
                                         "num_accepted": n})


@pytest.mark.parametrize("impl", [*SAMPLERS, "fake"])
def test_bad_rejection_sample_outputs_are_named(impl):
    args = rejection_sample_inputs()
    ids, n = _sampler_outputs(args)
    into = torch.ops.dflash.rejection_sample.out if impl == "fake" else SAMPLERS[impl]()[1]
    if impl == "fake":
        mode = torch._subclasses.fake_tensor.FakeTensorMode()
        args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in args.items()}
        ids, n = mode.from_tensor(ids), mode.from_tensor(n)
    with pytest.raises(ValueError, match="rejection_sample: output_token_ids has shape "
                                         "\\[4, 3\\], expected size 4 in dim 1"):
        into(**args, output_token_ids=ids[:, :3], num_accepted=n)
    with pytest.raises(ValueError, match="rejection_sample: num_accepted has dtype torch.int32, "
                                         "expected torch.int64"):
        into(**args, output_token_ids=ids, num_accepted=n.int())


@pytest.fixture
def capturing():
    emu = ascend_emu.ops()
    emu.set_capturing(True)
    yield emu
    emu.set_capturing(False)


def test_the_capture_contract(capturing):
    """While capturing: `.out` with check=False copies nothing either way and allocates no
    output, and computes what the op does; the allocating call and a checking call are refused,
    each naming why."""
    emu = capturing
    args = _inputs("tree")
    emu.set_capturing(False)
    expected = emu.paged_attention(**args)
    emu.set_capturing(True)
    out = torch.empty_like(args["query"])
    transfers, allocations = emu.transfers(), emu.allocations()
    emu.paged_attention.out(**{**args, "check": False}, out=out)
    assert (emu.transfers(), emu.allocations()) == (transfers, allocations)
    assert torch.equal(out, expected)
    with pytest.raises(RuntimeError, match="dflash::paged_attention allocates its output while "
                                           "capturing"):
        emu.paged_attention(**{**args, "check": False})
    with pytest.raises(RuntimeError, match="copy while capturing"):
        emu.paged_attention.out(**args, out=out)
    rs = {**rejection_sample_inputs(), "check": False}
    with pytest.raises(RuntimeError, match="dflash::rejection_sample allocates its output"):
        emu.rejection_sample(**rs)
    ids, n = _sampler_outputs(rs)
    emu.rejection_sample.out(**rs, output_token_ids=ids, num_accepted=n)
    assert (emu.transfers(), emu.allocations()) == (transfers, allocations)
    emu.set_capturing(False)
    want_ids, want_n = emu.rejection_sample(**rs)
    assert torch.equal(ids, want_ids) and torch.equal(n, want_n)


def test_outside_capture_the_functional_call_allocates_one_output():
    emu = ascend_emu.ops()
    args = _inputs("causal")
    before = emu.allocations()
    emu.paged_attention(**args)
    assert emu.allocations() - before == 1
    emu.paged_attention.out(**args, out=torch.empty_like(args["query"]))
    assert emu.allocations() - before == 1

"""The verify step near its floor: the LM head reduced to an argmax without [N, V] logits (torch
chunks and the fused C++ kernel), bit-exact with the argmax of the full logits; the preallocated
token context; tree templates cached by shape; no logits copied for a proposer that does not read
them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_speculative import plain_greedy, tiny_llama

from draftsmith.kernels import cpu_layer
from draftsmith.kernels.verify import linear_argmax, target_argmax
from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
from draftsmith.runtime.decoding.autoregressive import generate_ar
from draftsmith.runtime.decoding.speculative import SpeculativeDecoder
from draftsmith.runtime.drafting.chain import ChainProposer, DecoderDrafter, SampledTreeProposer
from draftsmith.runtime.drafting.tree import DraftTree, tree_template
from draftsmith.runtime.target.cache import CacheFullError, TokenBuffer
from draftsmith.runtime.target.interface import TargetWrapper
from draftsmith.runtime.target.model import LeanDecoder, ModelConfig

pytestmark = pytest.mark.unit

RUNNABLE = [isa for isa in cpu_layer.ISAS if cpu_layer.why_unavailable(isa) is None]
needs_cpp = pytest.mark.skipif(not RUNNABLE, reason=str(cpu_layer.why_unavailable()))


def tie_weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[n, k] random rows, with the row that wins for a positive input copied to later rows (in the
    same 16-row block, another block of the same task, another chunk) so that the maximum is tied
    across all of them.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[3] = w[3].abs() * 4  # the winner for x > 0
    for j in [
        j for j in (9, 40, n - 1, n // 2 + 1) if j < n
    ]:  # ties after it: the first (row 3) must win
        w[j] = w[3]
    return w.to(dtype)


# ---- chunked argmax in torch ---------------------------------------------------------------------
def TIED_ROWS(n: int) -> set[int]:  # noqa: N802 - a table, read like the constant it was
    """tie_weights' row 3 and its copies."""
    return {3, 9, 40, n - 1, n // 2 + 1}


def chunked_argmax(x: torch.Tensor, w: torch.Tensor, chunk: int, linear=F.linear) -> torch.Tensor:
    """What linear_argmax guarantees: the first maximum of the logits as the chunked GEMM computes
    them [T]."""
    return target_argmax(
        torch.cat([linear(x, w[c : c + chunk]) for c in range(0, w.shape[0], chunk)], 1)
    )


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bound [T] on how far two GEMMs' roundings of one logit may differ: fp32 accumulation in
    another order (a few ulps of |x| . |w|) and the output's rounding to x's dtype (an ulp of the
    largest logit)."""
    accumulate = (
        8 * torch.finfo(torch.float32).eps * (x.float().abs() @ w.float().abs().T).max(-1).values
    )
    return accumulate + 2 * torch.finfo(x.dtype).eps * F.linear(x, w).float().abs().max(-1).values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_torch_linear_argmax_is_the_first_maximum_of_its_chunked_logits(dtype, chunk):
    """The guarantee on every BLAS: bit-equal to the argmax of the chunked logits; a maximum of the
    full-width logits up to the GEMM's rounding, and their argmax wherever the maximum is clear of
    the runner-up by more than it.
    """
    g = torch.Generator().manual_seed(1)
    n, k = 1003, 48
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(9, k, generator=g).to(dtype)
    got = linear_argmax(x, w, chunk)
    assert torch.equal(got, chunked_argmax(x, w, chunk))
    full, bound = F.linear(x, w).float(), rounding_bound(x, w)  # [T, V], [T]
    top2 = full.topk(2, -1).values  # [T, 2]
    assert (full.gather(1, got[:, None])[:, 0] >= top2[:, 0] - bound).all()
    clear = top2[:, 0] - top2[:, 1] > 2 * bound
    assert clear.any() and torch.equal(got[clear], full.argmax(-1)[clear])
    tied = tie_weights(n, k, dtype)
    # x > 0: row 3 and its copies give the maximum
    pos = torch.rand(5, k, generator=g).to(dtype) + 0.1
    got = linear_argmax(pos, tied, chunk)
    assert torch.equal(got, chunked_argmax(pos, tied, chunk)) and set(got.tolist()) <= TIED_ROWS(n)


def blas_rounding_by_chunk(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A GEMM that rounds an output differently with its place among the weight rows (as the AMX
    path of an Intel Xeon did): the rows of a slice starting at row r come out scaled by 1 + 1e-6 *
    (r % 5)."""
    start = w.storage_offset() // w.shape[1]
    return F.linear(x, w) * (1 + 1e-6 * (start % 5))


def test_a_blas_that_rounds_by_chunk_moves_only_ties_and_keeps_the_guarantee():
    """Issue 50's Xeon, injected on any CPU: with tied rows the chunked head may pick another copy
    of the maximum (never a smaller row), and it is still exactly the argmax of the chunked
    logits."""
    n, k = 1003, 48
    tied = tie_weights(n, k, torch.float32)
    pos = torch.rand(5, k, generator=torch.Generator().manual_seed(2)) + 0.1
    full = target_argmax(blas_rounding_by_chunk(pos, tied))
    assert full.tolist() == [3] * 5  # one full-width GEMM: every copy rounds alike, the first wins
    got = linear_argmax(pos, tied, 7, linear=blas_rounding_by_chunk)
    assert torch.equal(got, chunked_argmax(pos, tied, 7, blas_rounding_by_chunk))
    assert set(got.tolist()) <= TIED_ROWS(n) and not torch.equal(
        got, full
    )  # a copy in a later chunk won


def test_torch_linear_argmax_ranks_nan_first_and_refuses_bad_shapes():
    w, x = torch.randn(50, 8), torch.randn(2, 8)
    w[30] = float("nan")  # logits row 30 is NaN for any input: torch.argmax ranks NaN highest
    assert (
        linear_argmax(x, w, chunk=16).tolist() == [30, 30] == target_argmax(F.linear(x, w)).tolist()
    )
    with pytest.raises(ValueError, match=r"x \[T, K\], weight \[V, K\]"):
        linear_argmax(torch.randn(2, 8), torch.randn(10, 9))
    with pytest.raises(ValueError, match="chunk >= 1"):
        linear_argmax(x, w, chunk=0)


# ---- the fused C++ head --------------------------------------------------------------------------
@needs_cpp
@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize(
    "n", [37, 64, 16 * 9 + 5, 1003, 4096]
)  # partial blocks, whole groups, leftovers
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_cpp_linear_argmax_is_the_argmax_of_its_logits(isa, n, tokens):
    ext = cpu_layer.load_cpu_layer(isa)
    g = torch.Generator().manual_seed(n + tokens)
    k = 64
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(tokens, k, generator=g).bfloat16()
    packed = cpu_layer.pack_weight(w)
    assert torch.equal(
        ext.linear_argmax(x, packed, None, n), target_argmax(ext.linear(x, packed, None, n))
    )
    tied = tie_weights(n, k, torch.bfloat16)
    pos = (torch.rand(tokens, k, generator=g) + 0.1).bfloat16()
    packed = cpu_layer.pack_weight(tied)
    got = ext.linear_argmax(pos, packed, None, n)
    assert (
        torch.equal(got, target_argmax(ext.linear(pos, packed, None, n)))
        and got.tolist() == [3] * tokens
    )


@needs_cpp
@pytest.mark.parametrize("isa", RUNNABLE)
def test_cpp_linear_argmax_nan_bias_and_bad_input(isa):
    ext = cpu_layer.load_cpu_layer(isa)
    n, k = 200, 32
    w = torch.randn(n, k).bfloat16()
    w[130] = float("nan")
    x = torch.randn(4, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    packed = cpu_layer.pack_weight(w)
    assert ext.linear_argmax(x, packed, bias, n).tolist() == [130] * 4
    w[130] = 0.0
    packed = cpu_layer.pack_weight(w)
    assert torch.equal(
        ext.linear_argmax(x, packed, bias, n), target_argmax(ext.linear(x, packed, bias, n))
    )
    with pytest.raises(RuntimeError, match="do not match"):
        ext.linear_argmax(x, packed, None, n + 16)


# ---- the decoder's argmax head and the loop ------------------------------------------------------
def bf16_decoder(hf, linear_backend: str) -> LeanDecoder:
    weights = {k: v.detach().to(torch.bfloat16) for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    return LeanDecoder(
        config, weights, kernel_backend="torch", linear_backend=linear_backend
    ).eval()


@pytest.fixture(scope="module", params=["fp32", "bf16-cpp"])
def pair(request):
    """(name, model, drafter): fp32 dense, or bf16 through the fused C++ layer where it runs."""
    hf, model = tiny_llama(0, vocab=1003, head_scale=8.0)
    hf_d, drafter = tiny_llama(1, vocab=1003, head_scale=8.0)
    if request.param == "fp32":
        return "fp32", model, drafter
    if not RUNNABLE:
        pytest.skip("the fused C++ layer cannot run here")
    return "cpp", bf16_decoder(hf, "cpp"), bf16_decoder(hf_d, "cpp")


def test_forward_argmax_head_matches_logits(pair):
    name, model, _ = pair
    assert name != "cpp" or model.linear_plan.kind == "cpp"
    ids = torch.tensor([5, 9, 11, 400, 2, 7])
    full = model.forward(ids, model.allocate_cache(8))
    fused = model.forward(ids, model.allocate_cache(8), head="argmax")
    assert fused.logits is None and torch.equal(fused.argmax, target_argmax(full.logits))
    assert torch.equal(fused.hidden, full.hidden)
    last = model.forward(ids, model.allocate_cache(8), logits_for="last", head="argmax")
    assert last.argmax.tolist() == [int(full.logits[-1].float().argmax())]
    with pytest.raises(ValueError, match="head must be 'logits' or 'argmax'"):
        model.forward(ids, model.allocate_cache(8), head="probs")


class ForwardSpy(TargetWrapper):
    """Delegates to a decoder (and its ``argmax_head``), recording the ``head`` each verify forward
    asked for."""

    def __init__(self, model):
        super().__init__(model)
        self.model, self.heads = model, []

    def allocate_cache(self, max_len):
        return self.model.allocate_cache(max_len)

    def forward(self, *args, **kwargs):
        self.heads.append(kwargs.get("head", "logits"))
        return self.model.forward(*args, **kwargs)


def test_greedy_speculation_with_the_argmax_head_is_lossless(pair):
    """Chains and trees verified through the argmax head give plain greedy's tokens (full logits
    each step)."""
    _, model, drafter = pair
    prompt, new = [1, 5, 9, 300], 40
    reference = plain_greedy(model, prompt, new)
    assert generate_ar(model, prompt, new) == reference  # plain AR takes the argmax head too
    inner = DecoderDrafter(drafter, 256)
    spy = ForwardSpy(model)
    for proposer in (
        ChainProposer(inner, depth=3),
        SampledTreeProposer(inner, (2, 2, 1), temperature=0.0),
    ):
        # what a proposer declares when its accept() never reads logits (EAGLE)
        proposer.reads_logits = False
        spy.heads.clear()
        assert SpeculativeDecoder(spy, proposer).generate(prompt, new).tokens == reference
        assert spy.heads[0] == "logits" and set(spy.heads[1:]) == {
            "argmax"
        }  # the prefill keeps its logits row


def test_accepted_logits_go_only_to_a_proposer_that_reads_them():
    _, model = tiny_llama(0, vocab=96, head_scale=8.0)
    ref = plain_greedy(model, [1, 2, 3], 20)
    # a proposer that declares nothing gets the logits (the documented default;
    # tests/test_seams_runtime.py)
    for declares in (True, False):
        proposer, seen, spy = (
            ChainProposer(DecoderDrafter(model, 256), depth=2),
            [],
            ForwardSpy(model),
        )
        proposer.reads_logits = declares
        accept = proposer.accept
        proposer.accept = lambda ctx, accept=accept, seen=seen: (
            seen.append(ctx.logits),
            accept(ctx),
        )
        assert SpeculativeDecoder(spy, proposer).generate([1, 2, 3], 20).tokens == ref
        if declares:  # it needs logits: the full head runs and [a+1, V] rows arrive
            assert "argmax" not in spy.heads and all(
                x is not None and x.shape[1] == 96 for x in seen
            )
        else:
            assert "argmax" in spy.heads and all(x is None for x in seen)
        assert seen


def test_verify_argmax_matches_verify_on_logits():
    g = torch.Generator().manual_seed(0)
    verifier = GreedyVerifier()
    for trial in range(20):
        tree = DraftTree.from_parents(
            torch.randint(0, 5, (7,), generator=g), [-1, 0, 0, 1, 1, 2, 3]
        )
        logits = torch.randn(7, 5, generator=g)
        if trial % 2:  # make the drafted tokens match often, so long paths are accepted too
            logits[torch.arange(7), tree.tokens.roll(-1)] += 5
        assert verifier.verify_argmax(tree, target_argmax(logits)) == verifier.verify(tree, logits)
    with pytest.raises(ValueError, match="argmax at each of the 7 nodes"):
        verifier.verify_argmax(tree, torch.zeros(6, dtype=torch.long))


# ---- the token context and the tree templates ----------------------------------------------------
def test_token_buffer_grows_across_many_steps_and_crops():
    buf, ref, views = TokenBuffer([7, 8, 9], capacity=3 + 500), [7, 8, 9], []
    g = torch.Generator().manual_seed(0)
    while True:
        chunk = torch.randint(
            0, 1000, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g
        ).tolist()
        if len(ref) + len(chunk) > buf.capacity:
            break
        views.append((buf.view(), list(ref)))
        buf.append(chunk)
        ref += chunk
        assert buf.view().tolist() == ref and buf.length == len(ref)
    assert len(views) > 150 and all(v.tolist() == r for v, r in views)  # earlier views never change
    buf.crop(10)
    buf.append([1, 2])
    assert buf.view().tolist() == ref[:10] + [1, 2]
    with pytest.raises(CacheFullError, match="do not fit"):
        buf.append([0] * buf.capacity)
    with pytest.raises(ValueError, match="crop length"):
        buf.crop(buf.length + 1)
    with pytest.raises(ValueError, match="cannot hold"):
        TokenBuffer([1, 2, 3], capacity=2)


def test_tree_templates_are_built_once_per_shape():
    a = DraftTree.chain([5, 6, 7, 8])
    b = DraftTree.chain([1, 2, 3, 4])
    assert (
        a.tree_mask is b.tree_mask
        and a.depths is b.depths
        and a.retrieve_indices is b.retrieve_indices
    )
    assert torch.equal(a.tree_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert a.depths.tolist() == [0, 1, 2, 3] and a.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    t = DraftTree.from_parents([1, 2, 3, 4], [-1, 0, 0, 1])
    assert t.tree_mask is not a.tree_mask and t.depths.tolist() == [0, 1, 1, 2]
    assert t.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3]]  # leaves in node order
    assert tree_template((-1, 0, 0, 1))[1] is t.tree_mask
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree.from_parents([1, 2], [-1, 1])


# ---- the EAGLE-3 draft step: static draft KV with a length counter -------------------------------

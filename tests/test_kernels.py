"""Kernel references against naive math, and Triton kernels against the references under
TRITON_INTERPRET=1.

Triton decides at import time whether ``@triton.jit`` builds compiled kernels or interpreter ones
(its own ``triton.language`` helpers included), so the interpreter must be switched on before triton
is first imported. The parity checks therefore run in a child Python process (this file run as a
script with TRITON_INTERPRET=1), and each test below asserts one of the results it reports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from draftsmith.kernels.attention import tree_attention, tree_attention_torch
from draftsmith.kernels.dispatch import KernelBackendError
from draftsmith.kernels.kv_compact import compact_kv
from draftsmith.kernels.verify import greedy_verify

pytestmark = pytest.mark.unit

HAS_TRITON = importlib.util.find_spec("triton") is not None


def naive_attention(q, k, v, prefix_len, tree_mask, scale):
    """Explicit GQA attention with a full [T, S] boolean mask."""
    hq, t, _ = q.shape
    group = hq // k.shape[0]
    kk = k.repeat_interleave(group, 0)[:, : prefix_len + t]
    vv = v.repeat_interleave(group, 0)[:, : prefix_len + t]
    mask = torch.ones(t, prefix_len + t, dtype=torch.bool)
    mask[:, prefix_len:] = (
        torch.ones(t, t, dtype=torch.bool).tril() if tree_mask is None else tree_mask
    )
    scores = (q @ kk.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ vv


def random_tree_mask(t: int, gen: torch.Generator) -> torch.Tensor:
    """A valid tree mask: random parents, each node sees itself and its ancestors."""
    mask = torch.eye(t, dtype=torch.bool)
    for i in range(1, t):
        parent = int(torch.randint(0, i, (1,), generator=gen))
        mask[i] |= mask[parent]
    return mask


ATTN_CASES = [  # (Hq, Hkv, T, S, prefix_len, d, tree)
    (4, 2, 1, 12, 9, 16, False),  # decode step, GQA
    (2, 2, 5, 40, 35, 8, False),  # causal chunk, prefix spans two key blocks
    (4, 1, 7, 70, 37, 24, True),  # tree, head dim not a power of two, MQA
    (2, 1, 20, 30, 3, 16, True),  # more queries than one query block
    (2, 2, 6, 6, 0, 8, True),  # no prefix
]


def attention_inputs(case, seed=0):
    hq, hkv, t, s, p, d, tree = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, t, d, generator=gen)
    k = torch.randn(hkv, s, d, generator=gen)
    v = torch.randn(hkv, s, d, generator=gen)
    return q, k, v, p, random_tree_mask(t, gen) if tree else None, d**-0.5


@pytest.mark.parametrize("case", ATTN_CASES)
def test_tree_attention_reference_matches_naive(case):
    q, k, v, p, mask, scale = attention_inputs(case)
    out = tree_attention(q, k, v, p, mask, scale, backend="torch")
    torch.testing.assert_close(out, naive_attention(q, k, v, p, mask, scale), atol=1e-5, rtol=1e-5)


def test_tree_attention_reference_is_differentiable():
    q, k, v, p, mask, scale = attention_inputs(ATTN_CASES[2])
    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
    q2, k2, v2 = (x.clone().requires_grad_() for x in (q, k, v))
    tree_attention_torch(q1, k1, v1, p, mask, scale).square().sum().backward()
    naive_attention(q2, k2, v2, p, mask, scale).square().sum().backward()
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_tree_attention_row_of_a_tree_equals_its_path_as_a_chain():
    """A node's output depends only on its ancestors: same result as running its root->node path
    causally."""
    gen = torch.Generator().manual_seed(3)
    parents = [-1, 0, 0, 1, 2, 3]
    mask = torch.eye(6, dtype=torch.bool)
    for i, par in enumerate(parents):
        if par >= 0:
            mask[i] |= mask[par]
    q, k, v = (
        torch.randn(2, 6, 8, generator=gen),
        torch.randn(1, 16, 8, generator=gen),
        torch.randn(1, 16, 8, generator=gen),
    )
    out = tree_attention(q, k, v, 10, mask, 0.3, backend="torch")
    path = [0, 1, 3, 5]
    kc, vc = k.clone(), v.clone()
    kc[:, 10:14], vc[:, 10:14] = k[:, [10 + i for i in path]], v[:, [10 + i for i in path]]
    chain = tree_attention(q[:, path], kc, vc, 10, None, 0.3, backend="torch")
    torch.testing.assert_close(out[:, 5], chain[:, 3], atol=1e-6, rtol=1e-6)


def test_compact_kv_reference():
    k = torch.randn(2, 3, 12, 4)
    v = torch.randn(2, 3, 12, 4)
    k0, v0 = k.clone(), v.clone()
    src = torch.tensor([5, 6, 9])  # overlapping: slot 5 is both a source and a destination
    compact_kv(k, v, src, 4, backend="torch")
    torch.testing.assert_close(k[:, :, 4:7], k0[:, :, [5, 6, 9]])
    torch.testing.assert_close(v[:, :, 4:7], v0[:, :, [5, 6, 9]])
    torch.testing.assert_close(k[:, :, :4], k0[:, :, :4])  # the prefix is untouched


def test_greedy_verify_reference_hand_example():
    paths = torch.tensor([[0, 1, 3, -1], [0, 1, 4, 5], [0, 2, -1, -1]])
    tokens = torch.tensor([9, 3, 4, 5, 6, 7])
    logits = torch.zeros(6, 10)
    logits[0, 3] = logits[1, 6] = logits[4, 7] = logits[5, 2] = 5.0  # path 1 matches all the way
    res = greedy_verify(paths, tokens, logits, backend="torch")
    assert (res.best_path, res.accept_len, res.bonus_token) == (1, 3, 2)
    assert res.accept_lens.tolist() == [1, 3, 0]


def test_greedy_verify_on_half_precision_logits_equals_the_plain_argmax_ties_included():
    """bf16/fp16 logits are widened before the argmax (faster on CPU): the argmax, ties resolved to
    the first maximum, must be exactly the one taken in the logits' own dtype."""
    torch.manual_seed(0)
    paths = torch.tensor([[0, 1, 2], [0, 3, -1]])
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(4, 300) * 4).round().to(dtype)  # coarse values: many ties per row
        # an exact tie for the maximum
        logits[:, 7] = logits[:, 250] = logits.max(-1).values.max() + 1
        tokens = torch.tensor([5, 7, 7, 9])
        res = greedy_verify(paths, tokens, logits, backend="torch")
        assert torch.equal(res.argmax, logits.argmax(-1)) and res.argmax.tolist() == [7, 7, 7, 7]
        assert (res.best_path, res.accept_len, res.bonus_token) == (0, 2, 7)


def test_greedy_walk_and_the_cpu_verifier_equal_the_tensor_reference_on_random_trees():
    """The host-side walk the CPU verifier uses makes greedy_verify's decision: best path (first on
    ties), accepted length, bonus, on random trees whose logits often agree with the drafted
    tokens."""
    from draftsmith.kernels.verify import greedy_walk
    from draftsmith.runtime.acceptance.verifiers import GreedyVerifier
    from draftsmith.runtime.drafting.tree import DraftTree

    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
        tokens = torch.randint(0, 6, (n,), generator=g)
        logits = torch.randn(n, 6, generator=g)
        if trial % 2:  # half the trees: make the target agree with many drafted children
            for child, parent in enumerate(parents[1:], start=1):
                if torch.rand(1, generator=g) < 0.7:
                    logits[parent, int(tokens[child])] += 10.0
        tree = DraftTree.from_parents(tokens, parents)
        paths = tree.retrieve_indices
        ref = greedy_verify(paths, tokens, logits, backend="torch")
        walked = greedy_walk(paths.tolist(), tokens.tolist(), logits.argmax(-1).tolist())
        assert walked == (ref.best_path, ref.accept_len, ref.bonus_token)
        for dtype in (torch.float32, torch.bfloat16):
            acc = GreedyVerifier().verify(tree, logits.to(dtype))
            ref_d = greedy_verify(paths, tokens, logits.to(dtype), backend="torch")
            assert acc.num_accepted == ref_d.accept_len and acc.bonus_token == ref_d.bonus_token
            assert acc.path_nodes == paths[ref_d.best_path, : ref_d.accept_len + 1].tolist()
    with pytest.raises(ValueError, match="start at a node"):
        greedy_walk([[-1, 0]], [1], [1])
    with pytest.raises(
        ValueError, match="expects paths"
    ):  # a wrong logits shape still gets greedy_verify's error
        GreedyVerifier().verify(DraftTree.chain([1, 2]), torch.zeros(3, 4))


def test_unknown_backend_lists_valid_ones():
    q, k, v, p, mask, scale = attention_inputs(ATTN_CASES[0])
    with pytest.raises(ValueError, match="valid backends are auto, torch, triton"):
        tree_attention(q, k, v, p, mask, scale, backend="cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        compact_kv(
            torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.tensor([2]), 1, backend="fast"
        )
    with pytest.raises(ValueError, match="unknown kernel backend"):
        greedy_verify(torch.tensor([[0, 1]]), torch.tensor([1, 2]), torch.zeros(2, 4), backend="")


def test_bad_shapes_are_explained():
    q = torch.randn(3, 2, 8)
    k = torch.randn(2, 10, 8)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q, k, k, 2, None, 1.0)
    with pytest.raises(ValueError, match="exceeds the cache length"):
        tree_attention(torch.randn(2, 2, 8), k, k, 9, None, 1.0)
    with pytest.raises(ValueError, match="exceed the cache length"):
        compact_kv(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.tensor([3, 4]), 3)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_forcing_triton_on_cpu_without_interpreter_is_explained(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, p, mask, scale = attention_inputs(ATTN_CASES[0])
    with pytest.raises(KernelBackendError, match="needs CUDA tensors"):
        tree_attention(q, k, v, p, mask, scale, backend="triton")


def test_auto_uses_torch_on_cpu_and_package_import_does_not_load_triton():
    code = (
        "import sys, torch; import draftsmith.kernels as K; from draftsmith.kernels.dispatch import"
        " resolve_backend;assert resolve_backend('auto', torch.zeros(1)) =="
        " 'torch';K.tree_attention(torch.randn(2, 1, 4), torch.randn(1, 3, 4), torch.randn(1, 3,"
        " 4), 2, None, 0.5);print('triton' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(), check=True
    )
    assert out.stdout.strip() == "False"


# ---- Triton parity (child process with TRITON_INTERPRET=1) ---------------------------------------


def _child_env(interpret: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def _attention_error(q, k, v, prefix_len, mask, scale) -> float:
    """The largest absolute difference between the Triton tree attention and the reference."""
    ref = tree_attention(q, k, v, prefix_len, mask, scale, backend="torch")
    out = tree_attention(q, k, v, prefix_len, mask, scale, backend="triton")
    return float((ref - out).abs().max())


def _attention_errors() -> list[float]:
    """The worst error of each attention case, then of one with non-contiguous K/V."""
    errors = []
    for i, case in enumerate(ATTN_CASES):
        errors.append(_attention_error(*attention_inputs(case, seed=i)))
    # Non-contiguous K/V: one layer of a [S, L, Hkv, d]-ordered buffer viewed as [Hkv, S, d].
    q, _, _, p, mask, scale = attention_inputs(ATTN_CASES[2])
    buf = torch.randn(70, 2, 1, 24)
    k, v = buf[:, 0].permute(1, 0, 2), buf[:, 1].permute(1, 0, 2)
    errors.append(_attention_error(q, k, v, p, mask, scale))
    return errors


def _compact_errors() -> list[float]:
    """The worst K/V difference after compacting with Triton and with the reference."""
    errors = []
    gen = torch.Generator().manual_seed(0)
    for src, dst in ([5, 6, 7], 4), ([9, 13, 14, 20], 9), ([10, 15, 21], 3), ([30], 0):
        k = torch.randn(3, 2, 32, 40, generator=gen)
        v = torch.randn(3, 2, 32, 40, generator=gen)
        k2, v2 = k.clone(), v.clone()
        compact_kv(k, v, torch.tensor(src), dst, backend="torch")
        compact_kv(k2, v2, torch.tensor(src), dst, backend="triton")
        errors.append(float(max((k - k2).abs().max(), (v - v2).abs().max())))
    return errors


def _verify_fields(result) -> list:
    """Every field of a greedy_verify result, as plain Python values."""
    return [
        result.best_path,
        result.accept_len,
        result.bonus_token,
        result.accept_lens.tolist(),
        result.argmax.tolist(),
    ]


def _verify_agreements() -> list[bool]:
    """Whether Triton's greedy_verify equals the reference's, per vocabulary and seed."""
    agreements = []
    paths = torch.tensor([[0, 1, 3, 6], [0, 1, 4, -1], [0, 2, 5, -1], [0, 2, -1, -1]])
    for vocab, ties in ((3000, False), (50, True), (7, True)):
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            # Ties (small integer logits) check that both pick the first maximal index.
            logits = (
                torch.randint(0, 3, (7, vocab), generator=g).float()
                if ties
                else torch.randn(7, vocab, generator=g)
            )
            amax = logits.argmax(-1)
            tokens = torch.randint(0, vocab, (7,), generator=g)
            tokens[1], tokens[3] = amax[0], amax[1]  # make path 0 match for a while
            if seed % 2:
                tokens[6] = amax[3]
            a = greedy_verify(paths, tokens, logits, backend="torch")
            b = greedy_verify(paths, tokens, logits, backend="triton")
            agreements.append(_verify_fields(a) == _verify_fields(b))
    return agreements


def _parity_report() -> dict:
    """Run every Triton kernel on CPU (interpreter) against its reference; return the worst
    errors."""
    return {
        "attention": _attention_errors(),
        "compact": _compact_errors(),
        "verify": _verify_agreements(),
    }


@pytest.fixture(scope="module")
def parity() -> dict:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    out = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        env=_child_env(interpret=True),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_triton_tree_attention_matches_reference(parity):
    assert len(parity["attention"]) == len(ATTN_CASES) + 1
    assert max(parity["attention"]) < 1e-5, parity["attention"]


def test_triton_compact_kv_matches_reference(parity):
    assert parity["compact"] and max(parity["compact"]) == 0.0, parity["compact"]


def test_triton_greedy_verify_matches_reference(parity):
    assert len(parity["verify"]) == 12 and all(parity["verify"]), parity["verify"]


# child process of the parity fixture (TRITON_INTERPRET=1 set before triton loads)
if __name__ == "__main__":
    print(json.dumps(_parity_report()))

"""One step of the speculative loop (runtime/decoding/speculative.py): the proposer drafts a tree
from the root, one target forward verifies it after the cache's prefix, the accepted path's K/V are
kept in place, and the proposer hears which path was accepted (hidden states, taps and, for a
proposer that reads them, logits at its nodes). The bonus token roots the next step's tree."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draftsmith.runtime.acceptance.verifiers import Acceptance
from draftsmith.runtime.decoding.spec_result import GenerationRecord
from draftsmith.runtime.drafting.base import StepContext
from draftsmith.runtime.drafting.tree import DraftTree
from draftsmith.runtime.target.cache import TokenBuffer
from draftsmith.runtime.target.interface import RuntimeCache
from draftsmith.runtime.target.output import TargetOutput

if TYPE_CHECKING:
    from draftsmith.runtime.decoding.speculative import SpeculativeDecoder


@dataclass
class LoopState:
    """What every step of one generation reads and updates."""

    cache: RuntimeCache
    device: torch.device
    taps: tuple[int, ...]  # the target layers whose inputs the proposer reads
    generator: torch.Generator | None
    greedy_head: bool  # verify from the target's argmax per node (no [N, V] logits)
    part: Callable[[str], AbstractContextManager]  # the profiler's part timer
    context: TokenBuffer  # prompt + emitted tokens, appended in place
    record: GenerationRecord
    root: int  # the token the next tree starts with
    hidden_prev: torch.Tensor  # [H]: the hidden state whose logits produced the root


def speculative_step(decoder: SpeculativeDecoder, loop: LoopState) -> bool:
    """Draft, verify and keep one tree; True when generation is over."""
    part, policy = loop.part, decoder.stop_policy
    with part("draft"):
        tokens = loop.context.view()  # [L+1]: a view; later appends do not change it
        tree = decoder.proposer.propose(
            StepContext(
                tokens=tokens,
                root_token=loop.root,
                hidden=loop.hidden_prev,
                stop_policy=policy,
                generator=loop.generator,
            )
        )
    check_tree(tree, loop.root, decoder.proposer.max_tree_nodes)
    prefix = loop.cache.length
    res, acc = _verify(decoder, tree, loop)
    nodes = acc.path_nodes
    in_place = nodes == list(range(len(nodes)))  # accepted nodes already sit right after the prefix
    with part("kv_compaction"):
        _keep_path(loop.cache, prefix, nodes, in_place)
    with part("proposer_update"):
        rows = slice(0, len(nodes)) if in_place else torch.tensor(nodes, device=res.hidden.device)
        loop.hidden_prev = _accept_path(decoder, res, acc, rows, tokens, loop)
    loop.root = acc.bonus_token
    loop.record.step(acc.num_accepted, tree)
    emitted = len(loop.record.tokens)
    done = loop.record.emit([*acc.accepted_tokens, loop.root])
    loop.context.append(loop.record.tokens[emitted:])
    return done


def check_tree(tree: DraftTree, root: int, max_tree_nodes: int) -> None:
    """Refuse a drafted tree that does not start at ``root`` or has more nodes than the cache was
    sized for."""
    if int(tree.tokens[0]) != root:
        raise ValueError("the proposer's tree must start with the root token it was given")
    if tree.num_nodes > max_tree_nodes:
        raise ValueError(
            f"the proposer drafted {tree.num_nodes} nodes but declared max_tree_nodes="
            f"{max_tree_nodes}; the KV cache is sized from the latter"
        )


def _verify(
    decoder: SpeculativeDecoder, tree: DraftTree, loop: LoopState
) -> tuple[TargetOutput, Acceptance]:
    """One target forward over ``tree`` after the cache's prefix, then the verifier's decision:
    (output, acceptance). ``loop.greedy_head``: the forward reduces its LM head to each node's
    argmax (no [N, V] logits).
    """
    with loop.part("verify_forward"):
        positions = (loop.cache.length + tree.depths).to(loop.device)  # siblings share a position
        mask = tree.tree_mask.to(loop.device) if tree.num_nodes > 1 else None
        head = {"head": "argmax"} if loop.greedy_head else {}
        res = decoder.model.forward(
            tree.tokens.to(loop.device),
            loop.cache,
            tree_mask=mask,
            positions=positions,
            taps=loop.taps,
            **head,
        )
    with loop.part("verification"):
        if loop.greedy_head:
            return res, decoder.verifier.verify_argmax(tree, res.argmax)
        return res, decoder.verifier.verify(
            tree, res.logits, loop.generator, **decoder.temperatures(res.hidden)
        )


def _accept_path(
    decoder: SpeculativeDecoder,
    res: TargetOutput,
    acc: Acceptance,
    rows: slice | torch.Tensor,
    tokens: torch.Tensor,
    loop: LoopState,
) -> torch.Tensor:
    """Tell the proposer which path the verifier accepted (``rows``: its nodes, the root first; a
    slice when they are the first nodes, the usual case, so that every row set below is a view):
    hidden states, taps and logits at its nodes (no logits for a proposer that declares
    ``reads_logits = False``: copying [a+1, V] rows every step for nobody cost ~0.1 ms a step);
    returns the hidden state [H] of the last accepted node, whose logits produced the bonus
    token."""

    def pick(t: torch.Tensor) -> torch.Tensor:  # the accepted rows of t
        return t[rows] if isinstance(rows, slice) else t[rows.to(t.device)]

    proposer = decoder.proposer
    logits = pick(res.logits) if proposer.reads_logits else None  # [a+1, V]
    proposer.accept(
        StepContext(
            tokens=tokens,
            root_token=loop.root,
            hidden=pick(res.hidden),  # [a+1, H]
            stop_policy=decoder.stop_policy,
            generator=loop.generator,
            taps=res.tap_features(loop.taps, rows),
            logits=logits,  # taps [a+1, k*H]
            acceptance=acc,
        )
    )
    return res.hidden[acc.path_nodes[-1]]


def _keep_path(cache: RuntimeCache, prefix: int, nodes: list[int], in_place: bool) -> None:
    """Keep the accepted nodes' K/V after the ``prefix`` committed slots: a commit when they already
    sit there."""
    if in_place:
        cache.commit(len(nodes))
    else:
        cache.compact(prefix + torch.tensor(nodes, dtype=torch.long), prefix)

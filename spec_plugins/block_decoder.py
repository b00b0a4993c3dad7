"""DDTree speculative decoding over a DFlash block drafter, engine-free (HF target).

The oracle for the engine integrations of block drafters and the tool that
measures their acceptance per step, chain against tree with the same drafter:

    dec = BlockTreeDecoder(target, drafter)   # HF LlamaForCausalLM + spec_plugins.heads.DFlashDrafter
    out = dec.generate(prompt_ids, 128, topk=4, num_nodes=15)    # DDTree: 15 drafts + the root
    out = dec.generate(prompt_ids, 128, topk=1, num_nodes=7)     # DFlash's own chain of 7
    out.tokens == dec.greedy(prompt_ids, 128).tokens             # lossless, greedy
    # temperature > 0: distributed as dec.sample(...) (the drafts are deterministic top-K picks)

One iteration (``BlockTreeDecoder.step``):

* ``_draft``: one drafter forward over [root, mask x L] at positions
  kv_len..kv_len + L, attending to the target features of every committed
  position (vLLM's DFlash drafting), gives L per-position distributions;
  ``tree_drafting.block_topk`` + ``block_trees`` build DDTree's best-first
  tree of ``num_nodes`` drafts (``spec_tree_kernels.build_block_tree``);
* ``_build``: ``tree_from_parents`` gives positions, the QLEN_ONLY ancestor
  mask and the walk's links;
* verify, walk, KV move: ``TreeDecoder``'s, unchanged;
* ``_extend``: the accepted nodes' target features join the drafter's context.

A chain is the tree with topk = 1 and num_nodes = L (each position's top-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import spec_tree_kernels as stk
from spec_plugins.reference_decoder import Output, Sampling, Target, TreeDecoder, _Tree
from spec_plugins.tree_drafting import block_topk, block_trees

@dataclass
class BlockShape:
    """A DDTree configuration: block length L (the drafter's mask rows), top-K
    tokens per position, num_nodes drafts per tree (the root excluded)."""

    length: int
    topk: int
    num_nodes: int

    def __post_init__(self):
        stk.validate_block_tree_shape(self.length, self.topk, self.num_nodes)

    @property
    def num_steps(self) -> int:
        """The deepest a tree can reach (the walk's step bound)."""
        return min(self.length, self.num_nodes)


@dataclass
class _BlockState:
    cache: object  # the target's DynamicCache, length kv_len
    features: torch.Tensor  # [kv_len, n, H] target features of the committed positions
    kv_len: int
    root: int  # the last emitted token, not yet in the target's cache


class BlockTreeDecoder(TreeDecoder):
    def __init__(self, target_model, drafter, impl: str = "torch"):
        self.drafter = drafter.eval()
        # the target records the outputs of the drafter's target_layer_ids (inputs of the next layers)
        self.target = Target(target_model, drafter.c.capture_layers)
        self.impl = impl
        self.eos = target_model.config.eos_token_id

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, topk: int, num_nodes: int, stop_at_eos: bool = True,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Output:
        """DDTree decoding (topk = 1, num_nodes = L: the drafter's chain).
        temperature 0: token-identical to ``greedy``; > 0: distributed as ``sample``."""
        shape = BlockShape(self.drafter.c.num_masks, topk, num_nodes)
        return self._speculate(prompt_ids, shape, max_new_tokens, stop_at_eos, temperature, top_p, top_k, seed)

    def step(self, state: _BlockState, shape: BlockShape, sampling: Sampling | None, timer) -> list[int]:
        with timer.section("draft_block"):
            trees = self._draft(state, shape)
        t = self._build(state, trees)
        with timer.section("verify"):
            logits, aux, final = self.target.forward(t.candidates, t.tree.positions[0], state.cache, t.bias)
        res = self._walk(t, logits, shape.num_steps, sampling)
        emitted, path = self._move(state, res, shape.num_nodes + 1)
        self._extend(state, emitted, path, aux, final)
        return emitted.tolist()

    def _prefill(self, ids: torch.Tensor, sampling: Sampling | None, out: Output) -> _BlockState:
        cache = self.target.new_cache()
        logits, aux, _ = self.target.forward(ids, torch.arange(len(ids)), cache)
        root = int(logits[-1].argmax()) if sampling is None else sampling.draw(logits[-1])
        out.tokens.append(root)
        return _BlockState(cache, aux, kv_len=len(ids), root=root)

    def _draft(self, state: _BlockState, shape: BlockShape):
        logprobs = self.drafter.draft_block(state.features, state.root)  # [L, V]
        values, tokens = block_topk(logprobs[None], shape.topk)
        return block_trees(values, tokens, shape.num_nodes, impl=self.impl)

    def _build(self, state: _BlockState, trees) -> _Tree:
        T, kv_len = trees.parents.shape[1], state.kv_len
        tree = stk.tree_from_parents(trees.parents, torch.tensor([kv_len]), stk.TreeMaskMode.QLEN_ONLY, impl=self.impl)
        bias = torch.zeros(T, kv_len + T)
        bias[:, kv_len:] = torch.where(tree.tree_mask.view(T, T), 0.0, float("-inf"))
        return _Tree(torch.cat([torch.tensor([state.root]), trees.tokens[0]]), tree, bias)

    def _extend(self, state: _BlockState, emitted: torch.Tensor, path: torch.Tensor, aux, final) -> None:
        """The root and the accepted drafts are now committed: their target features
        join the context; the bonus token (the last emitted) is the next root."""
        state.features = torch.cat([state.features, aux[path]])
        state.kv_len += len(emitted)
        state.root = int(emitted[-1])

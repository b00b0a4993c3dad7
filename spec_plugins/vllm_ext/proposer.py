"""TreeEagleProposer: EAGLE-2 dynamic trees from an EAGLE-1 or EAGLE-3 head in vLLM.

Per request and step (``extend_and_draft``):

1. draft-extend: the head runs over the positions the target committed this
   step (a prompt chunk, or the accepted path root..last accepted node) with
   the target's features there (EAGLE-3: the head's aux layers; EAGLE-1: the
   last hidden state) and the token that follows each position; their head KV
   is written into vLLM's paged cache of the drafter layer at the positions'
   slots, next to the head KV of the earlier context (so prefix caching and
   preemption recompute keep working as for vLLM's own EAGLE);
2. tree drafting (``spec_plugins.tree_drafting``): topk expansion per step with
   cumulative scores, the branches' head KV kept in local tensors (never in
   the paged cache), and tie-safe ancestor-closed selection of T - 1 nodes.

The head math is ``spec_plugins.heads.EagleHead`` (plain torch) over weights
loaded from the head folder; vLLM's own EagleProposer still loads the head so
that vLLM allocates and manages the drafter layer's KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spec_plugins.heads import EagleHead
from spec_plugins.tree_drafting import DraftTree, TreeShape, draft_tree

from .config import TreeConfigError


@dataclass
class PagedHeadKV:
    """The drafter layer's K and V in vLLM's paged cache, each viewed as
    [num_blocks, block_size, Hkv, D] (slot s = [s // block_size, s % block_size])."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    def gather(self, block_row: np.ndarray, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [length, Hkv, D] of positions 0..length-1 of one request."""
        pos = torch.arange(length, device=self.k.device)
        blocks = torch.as_tensor(block_row[: math.ceil(length / self.block_size)], dtype=torch.int64,
                                 device=self.k.device)
        b, o = blocks[pos // self.block_size], pos % self.block_size
        return self.k[b, o], self.v[b, o]

    def scatter(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V [m, Hkv, D] at slots [m] int64."""
        b, o = slots // self.block_size, slots % self.block_size
        self.k[b, o] = k.to(self.k.dtype)
        self.v[b, o] = v.to(self.v.dtype)


@dataclass
class ExtendInput:
    """One request's committed positions this step.

    next_tokens [m] int64: the token after each position (the last one: the
    token the target just emitted, or the next prompt token mid-prefill);
    features: EAGLE-3 [m, n_aux, H], EAGLE-1 [m, H] target states at them;
    start: first position (= head KV already cached for 0..start-1);
    slots [m] int64 of positions start..start+m-1 in the drafter's cache;
    block_row: the request's block table row (drafter's KV cache group);
    draft: whether to draft a tree after extending.
    """

    next_tokens: torch.Tensor
    features: torch.Tensor
    start: int
    slots: torch.Tensor
    block_row: np.ndarray
    draft: bool


class TreeEagleProposer:
    def __init__(self, head: EagleHead, shape: TreeShape, impl: str = "torch"):
        self.head = head.eval()
        self.shape = shape
        self.impl = impl
        self.kind = head.c.kind

    @classmethod
    def for_vllm(cls, vllm_config, target_model, shape: TreeShape, device, impl: str) -> "TreeEagleProposer":
        """Load the head named by vLLM's speculative config and wire it to the target."""
        spec = vllm_config.speculative_config
        folder = resolve_head_folder(spec.draft_model_config.model)
        dtype = vllm_config.model_config.dtype
        head = EagleHead.load(folder, dtype=dtype).to(device)
        target_cfg = vllm_config.model_config.hf_text_config
        check_head_fits_target(head, target_cfg, spec.method, folder)
        vocab = target_cfg.vocab_size
        embed = target_model.model.embed_tokens.weight[:vocab]  # vLLM pads vocab rows
        lm_head = target_model.lm_head.weight[:vocab] if hasattr(target_model, "lm_head") else embed
        head.attach_target(embed, lm_head)
        return cls(head, shape, impl)

    @torch.inference_mode()
    def extend_and_draft(self, inp: ExtendInput, kv: PagedHeadKV) -> DraftTree | None:
        m = inp.next_tokens.shape[0]
        past_k, past_v = kv.gather(inp.block_row, inp.start)
        positions = torch.arange(inp.start, inp.start + m, device=inp.next_tokens.device)
        logits, hidden, k, v = self.head.step(inp.next_tokens, self.head.fuse(inp.features), positions,
                                              past_k, past_v)
        kv.scatter(inp.slots, k, v)
        if not inp.draft:
            return None
        return draft_tree(self.head, logits[-1], hidden[-1], torch.cat([past_k, k]), torch.cat([past_v, v]),
                          inp.start + m, self.shape, impl=self.impl)


def resolve_head_folder(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means: not available locally
        raise TreeConfigError(f"draft head {model!r}: not a local folder and not in the HF cache ({e})") from None


def check_head_fits_target(head: EagleHead, target_cfg, method: str, folder: Path) -> None:
    c = head.c
    want = "eagle3" if method == "eagle3" else "eagle1"
    if c.kind != want:
        raise TreeConfigError(f"draft head {folder} is an {c.kind} head but speculative method is {method!r}")
    if c.hidden_size != target_cfg.hidden_size:
        raise TreeConfigError(f"draft head {folder} hidden_size {c.hidden_size} != target hidden_size "
                              f"{target_cfg.hidden_size}")
    vocab = target_cfg.vocab_size
    if c.kind == "eagle1" and c.vocab_size != vocab:
        raise TreeConfigError(f"EAGLE-1 head {folder} vocab_size {c.vocab_size} != target vocab_size {vocab}")
    if c.kind == "eagle3":
        top = int(head.draft_to_target().max())
        if top >= vocab:
            raise TreeConfigError(f"EAGLE-3 head {folder} maps draft tokens to target id {top} >= target vocab "
                                  f"{vocab} (d2t does not fit this target)")
        layers = target_cfg.num_hidden_layers
        bad = [i for i in c.aux_layer_ids if not 0 <= i < layers]
        if bad:
            raise TreeConfigError(f"EAGLE-3 head {folder} reads aux layers {bad}; the target has {layers} layers")

"""Draft models for SmolLM2-135M-Instruct: the shipped, trained checkpoints.

The folders next to this file hold the two EAGLE heads the engines load
(``head_path("eagle3")`` / ``head_path("eagle1")``; ``load_head`` reads one
into ``EagleHead``, ``eagle_head.py``) and the DFlash block drafter
(``drafter_path("dflash")``; ``load_drafter`` reads it into
``DFlashDrafter``, ``dflash_head.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_plugins.heads.eagle_head import EagleHead, HeadConfig

HEADS_DIR = Path(__file__).resolve().parent
SHIPPED = {"eagle3": "smollm2-135m-eagle3", "eagle1": "smollm2-135m-eagle1"}
# Block drafters (one forward drafts a whole block): ``dflash_head.DFlashDrafter`` checkpoints.
BLOCK_DRAFTERS = {"dflash": "smollm2-135m-dflash"}


def head_path(kind: str) -> Path:
    """Folder of the shipped, trained head for SmolLM2-135M-Instruct."""
    return HEADS_DIR / SHIPPED[kind]


def drafter_path(kind: str = "dflash") -> Path:
    """Folder of the shipped, trained block drafter for SmolLM2-135M-Instruct."""
    return HEADS_DIR / BLOCK_DRAFTERS[kind]


def load_drafter(kind_or_path="dflash", target=None, dtype=torch.float32):
    """The shipped block drafter (or a folder) as ``DFlashDrafter``, wired to ``target`` when given."""
    from spec_plugins.heads.dflash_head import DFlashDrafter

    path = drafter_path(kind_or_path) if kind_or_path in BLOCK_DRAFTERS else Path(kind_or_path)
    drafter = DFlashDrafter.load(path, dtype=dtype).eval()
    if target is not None:
        drafter.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter


def load_head(kind_or_path, target=None, dtype=torch.float32) -> EagleHead:
    """A head from a shipped kind ("eagle1"/"eagle3") or a folder, wired to ``target``
    (an HF LlamaForCausalLM) when given."""
    path = head_path(kind_or_path) if kind_or_path in SHIPPED else Path(kind_or_path)
    head = EagleHead.load(path, dtype=dtype).eval()
    if target is not None:
        head.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head


__all__ = ["BLOCK_DRAFTERS", "EagleHead", "HeadConfig", "HEADS_DIR", "SHIPPED", "drafter_path", "head_path",
           "load_drafter", "load_head"]

"""EAGLE draft heads for SmolLM2-135M-Instruct: the shipped, trained checkpoints.

The folders next to this file hold the two heads the engines load
(``head_path("eagle3")`` / ``head_path("eagle1")``); ``load_head`` reads one
into the torch module. The module itself, ``EagleHead`` and its
``HeadConfig``, is in ``eagle_head.py`` (re-exported here).
"""

from __future__ import annotations

from pathlib import Path

import torch

from spec_plugins.heads.eagle_head import EagleHead, HeadConfig

HEADS_DIR = Path(__file__).resolve().parent
SHIPPED = {"eagle3": "smollm2-135m-eagle3", "eagle1": "smollm2-135m-eagle1"}


def head_path(kind: str) -> Path:
    """Folder of the shipped, trained head for SmolLM2-135M-Instruct."""
    return HEADS_DIR / SHIPPED[kind]


def load_head(kind_or_path, target=None, dtype=torch.float32) -> EagleHead:
    """A head from a shipped kind ("eagle1"/"eagle3") or a folder, wired to ``target``
    (an HF LlamaForCausalLM) when given."""
    path = head_path(kind_or_path) if kind_or_path in SHIPPED else Path(kind_or_path)
    head = EagleHead.load(path, dtype=dtype).eval()
    if target is not None:
        head.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head


__all__ = ["EagleHead", "HeadConfig", "HEADS_DIR", "SHIPPED", "head_path", "load_head"]

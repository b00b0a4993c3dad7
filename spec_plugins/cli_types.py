"""Argument types shared by the command-line tools (``spec-plugins``,
``python -m spec_plugins.acceptance_bench``), importable without the CLI."""

from __future__ import annotations

import argparse


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"5,4,8"`` -> (num_steps, topk, num_draft_tokens), for argparse ``type=``."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be num_steps,topk,num_draft_tokens (e.g. 5,4,8)")
    return shape

"""Argument types shared by the command-line tools (``spec-plugins``,
``python -m spec_plugins.acceptance_bench``), importable without the CLI."""

from __future__ import annotations

import argparse

from spec_tree_kernels import TreeShape


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"5,4,8"`` -> (num_steps, topk, num_draft_tokens), for argparse ``type=``:
    ``TreeShape.parse`` (the spelling and the validation), as the plain triple
    the tools key their runs by."""
    try:
        return TreeShape.parse(text).as_tuple()
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None

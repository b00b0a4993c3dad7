"""Moved: the tree-attention benchmark (issue #17's sweep, the split-count
scan, copy bandwidth, targets) is ``spec_plugins.kernel_bench.attention``,
part of the repository's one kernel benchmark harness (not in the wheel):

    python -m spec_plugins.kernel_bench.attention          # the sweep, on a GPU

What is left here only keeps ``attention.bench_tree_attention`` and
``python -m spec_tree_kernels.attention`` working from a checkout until
kernels/attention.py stops importing this module; then this file goes.
"""

from __future__ import annotations


def bench_tree_attention(*args, **kwargs) -> list[dict]:
    """``spec_plugins.kernel_bench.attention.bench_tree_attention`` (a checkout only)."""
    from spec_plugins.kernel_bench.attention import bench_tree_attention as bench

    return bench(*args, **kwargs)


def main() -> None:
    from spec_plugins.kernel_bench.attention import main as sweep_main

    sweep_main()


if __name__ == "__main__":
    main()

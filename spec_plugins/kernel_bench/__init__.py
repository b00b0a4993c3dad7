"""The benchmark harness of the tree kernels (repository only: not in the wheel).

One timer, one "bench a point" routine, one sweep loop, used by every
benchmark of ``spec_tree_kernels``:

    timer.py     Timer: CUDA events, eager and CUDA-graph replay, warm or
                 L2-cold; the wall clock without CUDA
    points.py    Call (op, impl, fn); bench_point: the calls at one point ->
                 rows of figures; run_sweep: a grid of points under a deadline
    tree_ops.py  select / verify / sampled verify / KV move / build per mode
                 at one (batch, T) and its contexts, SGLang's kernels beside ours
    report.py    the per-implementation table, mask bytes, the headline step
                 comparison with SGLang
    attention.py tree attention: the issue #17 sweep, the split-count scan,
                 copy bandwidth, the targets
    __main__.py  ``python -m spec_plugins.kernel_bench`` (ci/bench.sh)

Entry points: the kernel benchmark CLI (``__main__``), the GPU device check's
bench and tree-attention sections (ci/device_check.py) and ``python -m
spec_plugins.kernel_bench.attention``. The submodules import
``spec_tree_kernels``: under TRITON_INTERPRET=1 set it before importing them.
"""

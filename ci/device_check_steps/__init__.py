"""The sections of ci/device_check.py, one module each, and their plumbing.

    plumbing.py           Report, Budget, Tally, CheckRun, byte comparison, this checkout's kernels
    environment.py        [env], the CUDA build, SGLang's kernels, [summary]
    cases.py              random inputs of the correctness checks
    correctness.py        [correctness]: triton / cuda against the torch reference
    sglang_crosscheck.py  [sglang_crosscheck]: SGLang's Triton build and verify against ours
    sanitizer.py          [sanitizer]: compute-sanitizer over a child run of the checks
    bench.py              [bench], [headline]: the tree ops through spec_plugins.kernel_bench
    attention.py          [tree_attention]: issue #17's checks, sweep, scan and targets
    sections.py           the order of the sections

Every module but plumbing imports spec_tree_kernels: device_check.py imports
them once TRITON_INTERPRET is settled and this checkout's kernels are loaded.
"""

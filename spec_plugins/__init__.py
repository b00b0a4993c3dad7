"""spec-plugins: tree-shaped EAGLE speculative decoding for vLLM and SGLang.

The engine-agnostic tree ops live in ``spec_tree_kernels`` (the repository's
``kernels/`` folder); ``spec_plugins.vllm_ext`` and ``spec_plugins.sglang_ext``
are the engine adapters, loaded through the engines' plugin entry points.
Importing this package imports no engine.
"""

__version__ = "0.1.0"

"""Every vLLM engine the package and its tests build states its KV cache size.

On vLLM-CPU the default sizing is a share of the memory free on NUMA node 0,
so an engine sized that way starts or not depending on what else runs on the
machine (issue 12, finding 1: the heads test failed on a fresh machine). An
explicit kv_cache_memory_bytes replaces that share, so every engine the
package and its tests build must state one: LLM(...) calls and ``vllm serve``
launches. Read from the source, no engine needed.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("spec_plugins", "tests") for p in (ROOT / d).rglob("*.py") if p != Path(__file__).resolve())


def _llm_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "LLM") or (isinstance(f, ast.Attribute) and f.attr == "LLM"):
                yield node


def _defines_kv_bytes(tree: ast.AST) -> bool:
    """The module builds engine kwargs with kv_cache_memory_bytes (dict(...) or {...})."""
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "kv_cache_memory_bytes":
            return True
        if isinstance(node, ast.Constant) and node.value == "kv_cache_memory_bytes":
            return True
    return False


def _serve_calls(tree: ast.AST):
    """Calls of a test's ``serve(tmp_path, prompts, [args...])`` launcher of ``vllm serve``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "serve":
            yield node


def test_every_served_engine_states_its_kv_cache_size():
    """``vllm serve`` launches pass --kv-cache-memory-bytes in their argument list."""
    missing, launches = [], 0
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for call in _serve_calls(tree):
            launches += 1
            args = [c.value for arg in call.args if isinstance(arg, ast.List) for c in arg.elts
                    if isinstance(c, ast.Constant)]
            if "--kv-cache-memory-bytes" not in args:
                missing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert launches >= 2, "the serve tests' launcher was not found: update this check"
    assert not missing, f"vllm serve without --kv-cache-memory-bytes: {missing}"


def test_every_llm_call_states_its_kv_cache_size():
    missing = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for call in _llm_calls(tree):
            names = {k.arg for k in call.keywords}
            if "kv_cache_memory_bytes" in names:
                continue
            if None in names and _defines_kv_bytes(tree):  # LLM(**engine_kwargs(...)) from a builder in the module
                continue
            if not call.keywords and not call.args:
                continue
            missing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    # The startup-refusal test builds LLM() that fails before sizing anything.
    missing = [m for m in missing if not m.startswith("tests/model/test_vllm_tree_config.py")]
    assert not missing, f"LLM(...) without kv_cache_memory_bytes: {missing}"


def test_vllm_check_engines_state_their_kv_cache_size():
    from spec_plugins.heads.vllm_check import engine_kwargs

    kw = engine_kwargs("model")
    assert kw["kv_cache_memory_bytes"] > 0


def test_the_shared_engine_settings_leave_the_kv_cache_size_to_each_engine():
    """``vllm_runs.engine_kwargs`` (the settings every engine shares) has no
    default KV size: an engine built from it cannot leave the size out."""
    from spec_plugins.vllm_runs import engine_kwargs

    for name in ("kv_cache_memory_bytes", "max_model_len"):
        param = inspect.signature(engine_kwargs).parameters[name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is inspect.Parameter.empty, name
    with pytest.raises(TypeError, match="kv_cache_memory_bytes"):
        engine_kwargs("model", max_model_len=512)
    kw = engine_kwargs("model", max_model_len=512, kv_cache_memory_bytes=7 << 20, block_size=32)
    assert (kw["kv_cache_memory_bytes"], kw["max_model_len"], kw["block_size"]) == (7 << 20, 512, 32)


def _states_the_shared_executor(tree: ast.AST) -> bool:
    """The module spells out distributed_executor_backend="uni" (keyword or dict key)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "distributed_executor_backend":
            if isinstance(node.value, ast.Constant) and node.value.value == "uni":
                return True
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and key.value == "distributed_executor_backend"
                        and isinstance(value, ast.Constant) and value.value == "uni"):
                    return True
    return False


def test_the_shared_engine_settings_are_written_once():
    """Engines take the shared settings from ``vllm_runs.engine_kwargs`` (one
    place), not from a copy of them; tests/model's TP engines override the
    executor with "mp", which is theirs to state."""
    shared = ROOT / "spec_plugins" / "vllm_runs.py"
    assert _states_the_shared_executor(ast.parse(shared.read_text())), "the check no longer finds the one place"
    copies = [str(p.relative_to(ROOT)) for p in SOURCES
              if p != shared and _states_the_shared_executor(ast.parse(p.read_text()))]
    assert not copies, f"engine settings copied instead of vllm_runs.engine_kwargs: {copies}"

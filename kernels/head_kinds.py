"""Draft-head kinds: EAGLE-1 and EAGLE-3, one detection rule and one spelling
per consumer.

Our checkpoints and tools say ``eagle1`` / ``eagle3`` (``HeadKind.value``);
vLLM's ``speculative_config`` method says ``eagle`` / ``eagle3``
(``vllm_method``); SGLang's ``--speculative-algorithm`` says ``EAGLE`` /
``EAGLE3`` (``sglang_algorithm``).

Detection (``head_kind``) reads a head's ``config.json`` as a dict: our own
record (``spec_plugins.kind``) first, then the fields only EAGLE-3 heads carry
(``EAGLE3_CONFIG_KEYS``: ``eagle_config``, ``draft_vocab_size``), then the
architectures: EAGLE-3 when one names ``eagle3`` (any case: SGLang's
``LlamaForCausalLMEagle3``, ``Eagle3DeepseekV2ForCausalLM``), EAGLE-1
otherwise. The vLLM adapter and the bundled heads use ``head_kind``; SGLang
loads the head by its architecture, so that is all its adapter may look at
(``head_kind_of_architectures``).
"""

from __future__ import annotations

import enum
from typing import Iterable, Mapping


class HeadKind(str, enum.Enum):
    EAGLE1 = "eagle1"
    EAGLE3 = "eagle3"

    @property
    def vllm_method(self) -> str:
        return "eagle3" if self is HeadKind.EAGLE3 else "eagle"

    @property
    def sglang_algorithm(self) -> str:
        return "EAGLE3" if self is HeadKind.EAGLE3 else "EAGLE"

    @classmethod
    def parse(cls, name: str) -> "HeadKind":
        """Any spelling: eagle1 / eagle / EAGLE, eagle3 / EAGLE3 (any case)."""
        key = str(name).strip().lower()
        if key in ("eagle1", "eagle"):
            return cls.EAGLE1
        if key == "eagle3":
            return cls.EAGLE3
        raise ValueError(f"unknown draft-head kind {name!r}; expected eagle1 (eagle, EAGLE) or eagle3 (EAGLE3)")


SGLANG_ALGORITHMS = tuple(kind.sglang_algorithm for kind in HeadKind)  # ("EAGLE", "EAGLE3")
VLLM_METHODS = tuple(kind.vllm_method for kind in HeadKind)  # ("eagle", "eagle3")
# config.json fields of EAGLE-3 heads only (the reduced draft vocabulary, the aux-layer config).
EAGLE3_CONFIG_KEYS = ("eagle_config", "draft_vocab_size")


def head_kind_of_architectures(architectures: Iterable[str] | None) -> HeadKind:
    """EAGLE-3 when an architecture names it (any case), else EAGLE-1."""
    return HeadKind.EAGLE3 if any("eagle3" in str(a).lower() for a in architectures or ()) else HeadKind.EAGLE1


def head_kind(config: Mapping) -> HeadKind:
    """The kind of a head from its config.json (see the module doc)."""
    recorded = (config.get("spec_plugins") or {}).get("kind")
    if recorded:
        return HeadKind.parse(recorded)
    if any(key in config for key in EAGLE3_CONFIG_KEYS):
        return HeadKind.EAGLE3
    return head_kind_of_architectures(config.get("architectures"))

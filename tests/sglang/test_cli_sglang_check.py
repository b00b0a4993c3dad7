"""``spec-plugins check --engine sglang``: the kernel-level regression check
against SGLang 0.5.23's own tree kernels passes, and fails (exit 1, JUnit
failure) when our greedy walk is broken on purpose."""

from __future__ import annotations

from xml.etree import ElementTree as ET

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv(register_plugin=False)

import spec_tree_kernels  # noqa: E402
from spec_plugins import cli  # noqa: E402

pytestmark = pytest.mark.sglang


def failures(path):
    return [c for c in ET.parse(path).getroot().iter("testcase") if c.find("failure") is not None]


def test_sglang_kernel_check_passes(tmp_path):
    assert cli.main(["check", "--engine", "sglang", "--num-prompts", "12", "--junit", str(tmp_path / "j.xml")]) == 0
    assert len(list(ET.parse(tmp_path / "j.xml").getroot().iter("testcase"))) == 12
    assert failures(tmp_path / "j.xml") == []


def test_sglang_kernel_check_catches_a_broken_walk(tmp_path, monkeypatch):
    real = spec_tree_kernels.verify_tree_greedy

    def accepts_one_more(*args, **kwargs):
        res = real(*args, **kwargs)
        res.accept_length.add_(1)
        return res

    monkeypatch.setattr(spec_tree_kernels, "verify_tree_greedy", accepts_one_more)
    assert cli.main(["check", "--engine", "sglang", "--num-prompts", "6", "--junit", str(tmp_path / "j.xml")]) == 1
    bad = failures(tmp_path / "j.xml")
    assert bad and "greedy walk differs" in bad[0].find("failure").get("message")

"""``api.triton_available``: a missing Triton is the environment's (False, the
reference serves and Triton tests skip naming it); an error in our own Triton
module is ours and must raise, never become a quiet fallback or a skip."""

from __future__ import annotations

import sys

import pytest

import spec_tree_kernels as stk


@pytest.fixture(autouse=True)
def uncached():
    """triton_available is memoized: each test asks afresh, and leaves no answer behind."""
    stk.api.triton_available.cache_clear()
    yield
    stk.api.triton_available.cache_clear()


def test_missing_triton_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    assert stk.api.triton_available() is False


def test_an_error_in_our_triton_module_raises(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed: nothing of ours to import")
    monkeypatch.delitem(sys.modules, "spec_tree_kernels.triton_ops", raising=False)
    monkeypatch.delattr(stk, "triton_ops", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenModule("spec_tree_kernels.triton_ops"), *sys.meta_path])
    with pytest.raises(RuntimeError, match="bug in spec_tree_kernels.triton_ops"):
        stk.api.triton_available()


class _BrokenModule:
    """A meta path finder whose module fails while importing, as a bug of ours would."""

    def __init__(self, name):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise RuntimeError(f"bug in {fullname}")
        return None

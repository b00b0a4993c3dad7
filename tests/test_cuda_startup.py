"""CUDA kernels at engine startup (``spec_tree_kernels.prepare`` / ``cuda_ops.ensure_built``):
the Triton fallback decision, the build lock (stale vs live owners), the
killable build child. No GPU here: where a test needs torch to "see" a GPU
it patches ``torch.cuda.is_available`` and says so; locks, processes and the
build child are real.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import spec_tree_kernels as stk
from spec_tree_kernels import cuda_build_guard, cuda_ops
from spec_tree_kernels.cuda_backends import ExtensionBackend


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A process that has not tried to build yet, building into tmp_path."""
    monkeypatch.setattr(cuda_ops, "_state", {"loaded": False, "backend": None, "error": None})
    monkeypatch.setenv("SPEC_TREE_KERNELS_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("SPEC_TREE_KERNELS_CUDA_JIT", raising=False)
    monkeypatch.delenv("SPEC_TREE_KERNELS_IMPL", raising=False)
    return tmp_path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(path, pid, host=None, age=0.0):
    path.write_text(f"{pid} {host or socket.gethostname()} {time.time() - age:.0f}\n")
    if age:
        os.utime(path, (time.time() - age, time.time() - age))


# ------------------------------------------------------------- the decision


def test_no_nvcc_falls_back_to_triton_and_says_why(fresh_state, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no GPU on CI: pretend torch sees one
    monkeypatch.setattr(cuda_ops, "find_nvcc", lambda: None)
    caplog.set_level(logging.INFO, logger="spec_tree_kernels")
    impls = stk.prepare("cuda")
    assert cuda_ops.ensure_built() is False and "nvcc not found" in cuda_ops.load_error()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "nvcc not found" in warned[0].getMessage() and "Triton" in warned[0].getMessage()
    expected = "triton" if stk.api.triton_available() else "torch"
    assert impls == {"select": expected, "build": expected, "verify": expected, "verify_sampling": expected,
                     "move_kv": expected, "attention": expected, "block_tree": expected, "from_parents": expected,
                     "recurrent": expected, "keyed_randoms": expected}
    assert not list(fresh_state.glob("*.lock")), "no build was attempted, so no lock is left"


def test_ensure_built_tries_once_per_process(fresh_state, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or False)
    assert cuda_ops.ensure_built() is False and cuda_ops.ensure_built() is False
    assert len(calls) == 1 and cuda_ops.load_error() == "torch sees no CUDA device"


def test_a_failed_build_is_a_logged_fallback_not_an_exception(fresh_state, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend a GPU (none on CI)
    monkeypatch.setattr(cuda_ops, "find_nvcc", lambda: "/bin/true")

    def failing_child(args, timeout):
        raise TimeoutError("CUDA kernel build did not finish in 1s (killed)")

    monkeypatch.setattr(cuda_build_guard, "run_build_child", failing_child)
    assert cuda_ops.ensure_built(timeout=1) is False
    assert "did not finish" in cuda_ops.load_error()
    assert any("Triton" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert not (fresh_state / "build.lock").exists(), "the lock is released after a failed build"


def test_build_removes_torchs_orphaned_baton_under_our_lock(fresh_state, monkeypatch):
    """cpp_extension's lock file has no owner and is waited on forever; it is only
    taken while our lock is held, so one found then was left by a killed build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # pretend a GPU (none on CI)
    monkeypatch.setattr(cuda_ops, "find_nvcc", lambda: "/bin/true")
    (fresh_state / "extension").mkdir()
    baton = fresh_state / "extension" / "lock"
    baton.write_text("")
    _write_lock(fresh_state / "build.lock", _dead_pid())
    seen = {}

    def child(args, timeout):
        seen["baton"] = baton.exists()
        seen["ours"] = (fresh_state / "build.lock").read_text().split()[0]
        return "ctypes"

    monkeypatch.setattr(cuda_build_guard, "run_build_child", child)
    monkeypatch.setattr(cuda_ops, "compile_backend", lambda nvcc, choice: ExtensionBackend(None))
    assert cuda_ops.ensure_built(timeout=5) is True
    assert seen == {"baton": False, "ours": str(os.getpid())}
    assert not (fresh_state / "build.lock").exists()


# ------------------------------------------------------------------ the lock


def test_lock_of_a_killed_build_is_taken_over(tmp_path, caplog):
    path = tmp_path / "build.lock"
    _write_lock(path, _dead_pid())
    t0 = time.monotonic()
    with cuda_build_guard.BuildLock(path, timeout=30):
        assert path.read_text().split()[0] == str(os.getpid())
    assert time.monotonic() - t0 < 5 and not path.exists()
    assert any("stale" in r.getMessage() for r in caplog.records)


def test_lock_of_a_running_build_times_out_naming_its_owner(tmp_path):
    path = tmp_path / "build.lock"
    owner = subprocess.Popen(["sleep", "30"])
    try:
        _write_lock(path, owner.pid)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"held by pid {owner.pid}.*{path.name}|{path.name}.*pid {owner.pid}"):
            with cuda_build_guard.BuildLock(path, timeout=0.6):
                pass
        assert time.monotonic() - t0 > 0.5  # it waited; no upper bound: a loaded machine may take long to start
        assert path.read_text().split()[0] == str(owner.pid), "a live owner's lock is left alone"
    finally:
        owner.kill()
        owner.wait()


def test_lock_released_by_its_owner_is_taken(tmp_path):
    path = tmp_path / "build.lock"
    owner = subprocess.Popen(["sleep", "30"])
    _write_lock(path, owner.pid)
    releaser = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.5); os.unlink({str(path)!r})"])
    try:
        with cuda_build_guard.BuildLock(path, timeout=300):  # generous: the releaser's Python may start slowly under load
            assert path.read_text().split()[0] == str(os.getpid())
    finally:
        owner.kill()
        owner.wait()
        releaser.wait()


@pytest.mark.parametrize("content,age", [("", 60.0), ("7 other-host 0\n", 4000.0), ("garbage", 60.0)])
def test_locks_without_a_live_owner_are_stale(tmp_path, content, age):
    path = tmp_path / "build.lock"
    path.write_text(content)
    os.utime(path, (time.time() - age, time.time() - age))
    with cuda_build_guard.BuildLock(path, timeout=5, stale_after=3600):
        assert path.read_text().split()[0] == str(os.getpid())


def test_fresh_lock_of_another_host_is_waited_for(tmp_path):
    path = tmp_path / "build.lock"
    _write_lock(path, 7, host="other-host")
    with pytest.raises(TimeoutError, match="other-host"):
        with cuda_build_guard.BuildLock(path, timeout=0.3, stale_after=3600):
            pass


# ------------------------------------------------------------ the build child


def test_build_child_timeout_kills_its_process_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '900']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(900)")
    t0 = time.monotonic()
    # 10 s: long enough for the child to start and write its grandchild's pid on a loaded machine
    with pytest.raises(TimeoutError, match="did not finish in 10s"):
        cuda_build_guard.run_killable([sys.executable, "-c", script], timeout=10, what="CUDA kernel build")
    assert time.monotonic() - t0 < 300  # killed, not waited for (the child sleeps 900 s); generous under load
    grandchild = int(pid_file.read_text())
    for _ in range(3000):  # reparented to init, reaped shortly after the kill (up to 300 s under load)
        if not cuda_build_guard._pid_alive(grandchild):
            break
        time.sleep(0.1)
    assert not cuda_build_guard._pid_alive(grandchild), "nvcc/ninja under the build child must die with it"


def test_build_child_reports_a_failed_build():
    with pytest.raises(RuntimeError, match="unknown SPEC_TREE_KERNELS_CUDA_BACKEND='bogus'"):
        cuda_build_guard.run_build_child(["--compile", "bogus"], timeout=120)


def test_build_child_imports_this_package_not_one_found_by_name(tmp_path, monkeypatch):
    """The GPU check loads spec_tree_kernels from kernels/ without installing it
    (2026-11-30's device run could not build: the child ran
    ``python -m spec_tree_kernels.cuda_ops`` and found no such package). Here a
    decoy package of that name shadows every other in the child's working
    directory: the child must still run this package's cuda_ops."""
    decoy = tmp_path / "spec_tree_kernels"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('decoy spec_tree_kernels imported')\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="unknown SPEC_TREE_KERNELS_CUDA_BACKEND='bogus'"):
        cuda_build_guard.run_build_child(["--compile", "bogus"], timeout=120)

"""The CUDA kernel build, run so that it can never hang an engine.

Builds run in a child process under a timeout and behind a build lock that
records its owner's PID: a lock left by a killed build (its PID gone) is
removed, a live one is waited for at most the timeout. torch's own build lock
(``cpp_extension``'s file baton, which has no owner and waits forever) is only
ever taken while ours is held, so one found then is stale and removed
(``cuda_ops._build_and_load``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("spec_tree_kernels")

DEFAULT_BUILD_TIMEOUT_S = 600.0  # a cold nvcc build of tree_ops is 1-3 minutes
TIMEOUT_ENV = "SPEC_TREE_KERNELS_BUILD_TIMEOUT"
_EMPTY_LOCK_GRACE_S = 10.0  # a lock file whose owner has not written its PID yet


def build_timeout(timeout: float | None = None) -> float:
    if timeout is not None:
        return float(timeout)
    return float(os.environ.get(TIMEOUT_ENV) or DEFAULT_BUILD_TIMEOUT_S)


# ------------------------------------------------------------------ the lock


class BuildLock:
    """Exclusive build lock: a file holding ``pid host unix_time`` of its owner.

    Stale (removed, then taken) when its owner is gone: a PID no longer
    running on this host, an owner on another host older than ``stale_after``
    seconds, or an unwritten file older than a few seconds. Otherwise waits up
    to ``timeout`` seconds, then raises TimeoutError naming the owner and path.
    """

    def __init__(self, path: Path, timeout: float, stale_after: float | None = None):
        self.path = Path(path)
        self.timeout = timeout
        self.stale_after = stale_after if stale_after is not None else max(timeout, DEFAULT_BUILD_TIMEOUT_S)

    def __enter__(self) -> "BuildLock":
        deadline = time.monotonic() + self.timeout
        while not self._try_take():
            owner = self._owner_if_alive()
            if owner is None:
                continue  # stale: removed, try again at once
            if time.monotonic() >= deadline:
                raise TimeoutError(f"CUDA kernel build lock {self.path} is held by {owner}; waited {self.timeout:.0f}s "
                                   f"(delete the file if no build is running)")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _try_take(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n")
        return True

    def _owner_if_alive(self) -> str | None:
        """The owner's description while it may still be building; None after
        removing a stale lock."""
        try:
            text = self.path.read_text().split()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None  # released meanwhile
        if len(text) == 3 and text[0].isdigit():
            pid, host = int(text[0]), text[1]
            alive = _pid_alive(pid) if host == socket.gethostname() else age < self.stale_after
            if alive:
                return f"pid {pid} on {host} (for {age:.0f}s)"
            reason = f"pid {pid} on {host} is gone" if host == socket.gethostname() else f"{age:.0f}s old"
        elif age < _EMPTY_LOCK_GRACE_S:
            return f"an unknown owner (lock written {age:.0f}s ago)"
        else:
            reason = "it names no owner"
        logger.warning("spec_tree_kernels: removing stale CUDA build lock %s (%s)", self.path, reason)
        remove_if_exists(self.path)
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def remove_if_exists(path: Path) -> bool:
    try:
        Path(path).unlink()
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------- child builds


def run_build_child(args: list[str], timeout: float) -> str:
    """Run ``spec_tree_kernels.cuda_ops ARGS`` as ``__main__`` (a compile) in its own
    process group; kill the whole group (nvcc, ninja) after ``timeout``
    seconds. Returns the child's last stdout line; raises RuntimeError with
    its stderr tail on failure, TimeoutError on timeout."""
    package_dir = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-c", _BUILD_CHILD_BOOT, package_dir, *args]
    return run_killable(cmd, timeout, what="CUDA kernel build")


# The child imports this very package from its folder, so a build works
# whether the package is installed or loaded from a checkout's kernels/
# (ci/device_check.py on a machine where nothing is installed).
_BUILD_CHILD_BOOT = """
import importlib.util, runpy, sys
package_dir = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location(
    "spec_tree_kernels", package_dir + "/__init__.py", submodule_search_locations=[package_dir])
package = importlib.util.module_from_spec(spec)
sys.modules["spec_tree_kernels"] = package
spec.loader.exec_module(package)
runpy.run_module("spec_tree_kernels.cuda_ops", run_name="__main__", alter_sys=True)
"""


def run_killable(cmd: list[str], timeout: float, what: str) -> str:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"{what} did not finish in {timeout:.0f}s (killed; raise {TIMEOUT_ENV} "
                           "or prebuild on this machine)") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {err.strip()[-3000:]}")
    lines = out.strip().splitlines()
    return lines[-1] if lines else ""

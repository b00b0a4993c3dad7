"""Without a GPU, run Triton kernels through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
i.e. before ``spec_tree_kernels.triton_ops`` is imported. (Test modules get the
device from ``kernel_device``: ``conftest`` is not a unique module name once
subfolders have their own.)

Skips: every skip in this suite names a missing tool or environment (nvcc, a
C++ compiler, Triton's interpreter, SGLang's or the SmolLM2 venv). CI provides
all of them, so ci/test.sh sets SPEC_PLUGINS_NO_SKIPS=1 and any skip there
fails the run: a skip must never stand in for a test of ours that did not run.
"""

import os

import kernel_device  # noqa: F401  (sets TRITON_INTERPRET)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("SPEC_PLUGINS_NO_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        for report in skipped:
            print(f"\nSPEC_PLUGINS_NO_SKIPS: {report.nodeid} skipped: {report.longrepr}")
        session.exitstatus = 1

"""The engine version gate (issue 19, item 9): post releases and local builds of
a tested release pass; anything else is refused, and the refusal is logged
with its reason (engines load plugins in every process and may only log a
failed plugin, so the user must find why next to "Unknown speculative
algorithm"). Engine-free: the installed version is what the gate reads from
``importlib.metadata``, replaced here by a fixed answer.
"""

from __future__ import annotations

import logging

import pytest

from spec_plugins import engine_versions as ev

SGLANG = ("0.5.23",)
VLLM = ("0.32.0", "0.33.0")

ACCEPTED = [
    ("0.5.23", SGLANG), ("0.5.23.post1", SGLANG), ("0.5.23post2", SGLANG), ("0.5.23-1", SGLANG),
    ("0.5.23.post1+cu128", SGLANG), ("0.32.0.post2", VLLM), ("0.32.0+cpu", VLLM), ("0.33.0.post1+cpu", VLLM),
]  # fmt: skip
REFUSED = [
    ("0.5.24", SGLANG), ("0.5.230", SGLANG), ("0.5.2", SGLANG), ("0.5.23rc1", SGLANG), ("0.5.23.dev3", SGLANG),
    ("0.5.23.post1.dev0", SGLANG), ("1!0.5.23", SGLANG), ("0.32.1", VLLM), ("garbage", VLLM),
]  # fmt: skip


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.delenv(ev.ALLOW_UNTESTED_ENV, raising=False)

    def set_version(version):
        monkeypatch.setattr(ev.importlib.metadata, "version", lambda dist: version)

    return set_version


@pytest.mark.parametrize("version,tested", ACCEPTED)
def test_tested_releases_and_their_post_releases_pass(installed, version, tested):
    assert ev.is_tested_release(version, tested)
    installed(version)
    assert ev.check_engine_version("Engine", ("engine",), tested) == version


@pytest.mark.parametrize("version,tested", REFUSED)
def test_other_releases_are_refused_and_logged(installed, caplog, version, tested):
    assert not ev.is_tested_release(version, tested)
    installed(version)
    with caplog.at_level(logging.ERROR, logger=ev.__name__):
        with pytest.raises(RuntimeError, match="not a tested release"):
            ev.check_engine_version("SGLang", ("sglang",), tested)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1
    assert f"SGLang {version}" in logged[0] and "plugin is not loaded" in logged[0] and ev.ALLOW_UNTESTED_ENV in logged[0]


def test_override_runs_an_untested_release_with_a_warning(installed, monkeypatch, caplog):
    installed("0.5.99")
    monkeypatch.setenv(ev.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=ev.__name__):
        assert ev.check_engine_version("SGLang", ("sglang",), SGLANG) == "0.5.99"
    assert any("0.5.99" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_not_installed_is_not_an_error(monkeypatch):
    def missing(dist):
        raise ev.importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(ev.importlib.metadata, "version", missing)
    assert ev.check_engine_version("SGLang", ("sglang",), SGLANG) is None

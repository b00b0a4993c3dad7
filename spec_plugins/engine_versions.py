"""Engine version gate shared by the adapters (no engine import at module load)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re

ALLOW_UNTESTED_ENV = "SPEC_PLUGINS_ALLOW_UNTESTED_ENGINE"

logger = logging.getLogger(__name__)

# release [post release] [+local build], PEP 440 spellings of the post part
# (0.5.23.post1, 0.5.23post1, 0.5.23-1). Pre and dev releases do not match:
# an rc of a tested release is not that release.
_VERSION = re.compile(r"(?P<release>\d+(?:\.\d+)*)(?:[-_.]?post[-_.]?\d*|-\d+)?(?:\+[a-z0-9._-]+)?", re.IGNORECASE)


def installed_version(distributions: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution, or None."""
    for dist in distributions:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tested_release_of(version: str, tested: tuple[str, ...]) -> str | None:
    """The tested release ``version`` is, or is a post release or local build
    of (post releases carry fixes only, not the internals we patch); else None."""
    match = _VERSION.fullmatch(version.strip())
    if match is None:
        return None
    release = match.group("release")
    return release if release in tested else None


def is_tested_release(version: str, tested: tuple[str, ...]) -> bool:
    return tested_release_of(version, tested) is not None


def check_engine_version(engine: str, distributions: tuple[str, ...], tested: tuple[str, ...]) -> str | None:
    """Return the installed version, raising on an untested one.

    The adapters patch engine internals that move between releases, so an
    untested release must fail loudly at plugin load rather than misbehave
    mid-request. ``SPEC_PLUGINS_ALLOW_UNTESTED_ENGINE=1`` overrides (at your risk).
    Every outcome but "not installed" and "a tested release" is logged: engines
    load plugins in every process and may only log a failed plugin, so the
    reason must be in the log next to the engine's own error (for SGLang,
    "Unknown speculative algorithm").
    """
    found = installed_version(distributions)
    if found is None:
        return None
    dist, version = found
    release = tested_release_of(version, tested)
    if release is not None:
        if release != version:
            logger.info("spec-plugins: %s %s is a build of the tested release %s", engine, version, release)
        return version
    message = (
        f"spec-plugins: {engine} {version} (distribution {dist}) is not a tested release; "
        f"tested: {', '.join(tested)} (and their post releases)."
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s Running anyway: %s=1.", message, ALLOW_UNTESTED_ENV)
        return version
    message += (
        f" The {engine} plugin is not loaded. Install a tested release, or set {ALLOW_UNTESTED_ENV}=1 to try anyway."
    )
    logger.error(message)
    raise RuntimeError(message)

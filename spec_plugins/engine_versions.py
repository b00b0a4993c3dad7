"""Engine version gate shared by the adapters (no engine import at module load)."""

from __future__ import annotations

import importlib.metadata
import os

ALLOW_UNTESTED_ENV = "SPEC_PLUGINS_ALLOW_UNTESTED_ENGINE"


def installed_version(distributions: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution, or None."""
    for dist in distributions:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_engine_version(engine: str, distributions: tuple[str, ...], tested: tuple[str, ...]) -> str | None:
    """Return the installed version, raising on an untested one.

    The adapters patch engine internals that move between releases, so an
    untested release must fail loudly at plugin load rather than misbehave
    mid-request. ``SPEC_PLUGINS_ALLOW_UNTESTED_ENGINE=1`` overrides (at your risk).
    """
    found = installed_version(distributions)
    if found is None:
        return None
    dist, version = found
    base = version.split("+")[0]
    if base not in tested and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(
            f"spec-plugins: {engine} {version} (distribution {dist}) is not a tested release; "
            f"tested: {', '.join(tested)}. Install a tested release, or set {ALLOW_UNTESTED_ENV}=1 "
            f"to try anyway."
        )
    return version

"""What the real control plane starts from: the binaries ``make controlplane`` built, and the
key the API server signs service-account tokens with."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

REPO = Path(__file__).resolve().parents[2]


def binaries_dir() -> Path | None:
    """The directory ``make controlplane`` built (bin/ and gateway-api/), or None.

    ``RTRL_CONTROLPLANE`` (set by the Makefile) wins; otherwise the newest complete build
    under ``.tools/``, so a plain ``pytest`` after one ``make`` finds it too."""
    configured = os.environ.get("RTRL_CONTROLPLANE")
    if configured:
        path = Path(configured)
        return path if (path / "VERSION").exists() else None
    builds = sorted(
        (p for p in (REPO / ".tools").glob("controlplane-*") if (p / "VERSION").exists()),
        key=lambda p: p.stat().st_mtime,
    )
    return builds[-1] if builds else None


def service_account_key(path: Path) -> Path:
    """A new EC private key (PEM, mode 0600) at ``path``."""
    key = ec.generate_private_key(ec.SECP256R1())
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return path

"""Ed25519 signatures of artifacts: `dsc keygen`, `dsc sign`, and the check behind
`--require-signature` / `dsc.load(..., require_signature=PUBKEY)`.

The signature covers manifest.json's bytes. The manifest records the sha256 of every other
file and the loader refuses files it does not list, so a valid signature with verified
checksums means no file was altered, added or removed since signing. signature.json sits
beside the manifest: {"algorithm": "ed25519", "public_key": hex, "signature": hex}.

`cryptography` is an optional dependency (the `sign` extra), imported only here and only when
a signature is made or checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dsc.errors import UserError

SIGNATURE_FILE = "signature.json"


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise UserError("signatures need the 'cryptography' package: pip install 'dsc[sign]'") from None
    return ed25519, serialization, InvalidSignature


def _raw_public(key) -> bytes:
    _, serialization, _ = _crypto()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keygen(private_path: str | Path) -> tuple[Path, Path]:
    """Write a new ed25519 key pair: PRIVATE (PEM, PKCS8, readable by its owner only) and
    PRIVATE.pub (PEM). Refuses to overwrite either."""
    ed25519, serialization, _ = _crypto()
    priv, pub = Path(private_path), Path(f"{private_path}.pub")
    for p in (priv, pub):
        if p.exists():
            raise UserError(f"{p}: exists; keygen does not overwrite keys")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    try:
        fd = os.open(priv, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise UserError(f"{priv}: cannot write ({e.strerror})") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return priv, pub


def _load_key(path: str | Path, private: bool):
    ed25519, serialization, _ = _crypto()
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot read key ({e.strerror})") from None
    try:
        key = (
            serialization.load_pem_private_key(data, password=None)
            if private
            else serialization.load_pem_public_key(data)
        )
    except (ValueError, TypeError):
        raise UserError(
            f"{path}: not a PEM {'private' if private else 'public'} key (make one with `dsc keygen`)"
        ) from None
    want = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, want):
        raise UserError(f"{path}: not an ed25519 key")
    return key


def write_signature(artifact: Path, manifest_bytes: bytes, private_key: str | Path) -> Path:
    """Sign manifest_bytes (the artifact's manifest.json) with PRIVATE_KEY; writes signature.json
    into the artifact directory, atomically. `dsc.runtime.artifact.sign` checks the artifact first."""
    key = _load_key(private_key, private=True)
    sig = {
        "algorithm": "ed25519",
        "public_key": _raw_public(key.public_key()).hex(),
        "signature": key.sign(manifest_bytes).hex(),
    }
    out = artifact / SIGNATURE_FILE
    tmp = artifact / f".{SIGNATURE_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(sig, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)
    return out


def verify_signature(artifact: Path, manifest_bytes: bytes, public_key: str | Path) -> None:
    """Raise UserError unless signature.json is a valid signature of manifest_bytes by the key."""
    _, _, InvalidSignature = _crypto()
    key = _load_key(public_key, private=False)
    f = artifact / SIGNATURE_FILE
    if not f.is_file() or f.is_symlink():
        raise UserError(f"{f}: missing; the artifact is not signed (sign it with `dsc sign`)")
    try:
        sig = json.loads(f.read_bytes())
        if not isinstance(sig, dict) or sig.get("algorithm") != "ed25519":
            raise ValueError
        signature = bytes.fromhex(sig["signature"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        raise UserError(f"{f}: malformed signature file") from None
    try:
        key.verify(signature, manifest_bytes)
    except InvalidSignature:
        raise UserError(
            f"{f}: signature does not match manifest.json and key {public_key} "
            "(artifact altered after signing, or signed by another key)"
        ) from None

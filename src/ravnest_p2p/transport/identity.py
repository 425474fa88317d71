"""Peer identity: one RSA key that is both the libp2p identity (peer id) and the DHT signing key.

Using the same key for both binds a signed DHT record to the peer id it claims: a reader derives the
peer id from the public key in the record's subkey and refuses records whose `peer_id` field differs.
The file is hivemind's format (a libp2p protobuf `PrivateKey` holding a DER RSA key), so `p2pd` reads
it directly. An existing file is never regenerated: a corrupt or unreadable one is an error, because a
silent new identity would orphan the peer's records and reputation.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from ravnest_p2p.errors import IdentityError

__all__ = ["Identity", "load_or_create_identity", "peer_id_from_public_key"]


@dataclass(frozen=True)
class Identity:
    path: Path | None
    private_key: RSAPrivateKey
    peer_id: str

    def to_file_bytes(self) -> bytes:
        """The key in hivemind's / libp2p's identity file format."""
        der = self.private_key._private_key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
        data: bytes = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
        return data

    @property
    def public_key_bytes(self) -> bytes:
        """OpenSSH encoding of the public key, the form hivemind's RSASignatureValidator embeds."""
        data: bytes = self.private_key.get_public_key().to_bytes()
        return data


def _wrap(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped


def _peer_id_of(public_key: rsa.RSAPublicKey) -> str:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return str(base58.b58encode(digest).decode())


def peer_id_from_public_key(openssh_public_key: bytes) -> str:
    """The libp2p peer id (base58) of an OpenSSH-encoded RSA public key."""
    try:
        key = RSAPublicKey.from_bytes(openssh_public_key)._public_key
    except Exception as exc:
        raise ValueError(f"not an RSA public key: {exc}") from None
    return _peer_id_of(key)


def _load(path: Path) -> Identity:
    try:
        data = path.read_bytes()
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("only RSA identities are supported")
        key = serialization.load_der_private_key(proto.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA private key")
    except OSError as exc:
        raise IdentityError(f"cannot read identity {path}: {exc.strerror}") from None
    except Exception as exc:
        raise IdentityError(f"identity file {path} is corrupt ({exc}); refusing to replace it") from None
    peer_id = _peer_id_of(key.public_key())
    # cross-check against hivemind's own derivation so p2pd and we agree on who we are
    if PeerID.from_identity(data).to_base58() != peer_id:
        raise IdentityError(f"identity file {path} yields inconsistent peer ids")
    return Identity(path=path, private_key=_wrap(key), peer_id=peer_id)


def load_or_create_identity(path: str | os.PathLike[str] | None) -> Identity:
    """Load the identity at `path`, creating it (mode 0400) only if the file does not exist.

    With `path=None` the identity is ephemeral: a fresh key that lives as long as the process.
    """
    if path is None:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        return Identity(path=None, private_key=_wrap(key), peer_id=_peer_id_of(key.public_key()))
    path = Path(path).expanduser()
    if path.exists():
        return _load(path)
    if not path.parent.is_dir():
        raise IdentityError(f"directory {path.parent} for the identity file does not exist")
    fresh = load_or_create_identity(None)
    # O_EXCL: if two processes race to create it, exactly one wins and the other loads the winner's key
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    except FileExistsError:
        return _load(path)
    with os.fdopen(fd, "wb") as f:
        f.write(fresh.to_file_bytes())
    return _load(path)

import os
import stat

import pytest
from hivemind.p2p import PeerID

from ravnest_p2p.errors import IdentityError
from ravnest_p2p.transport.identity import load_or_create_identity, peer_id_from_public_key


def test_identity_is_created_once_and_reloaded(tmp_path):
    path = tmp_path / "peer.key"
    first = load_or_create_identity(path)
    again = load_or_create_identity(path)
    assert first.peer_id == again.peer_id
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o400
    # hivemind/libp2p derive the same peer id from the file
    assert PeerID.from_identity(path.read_bytes()).to_base58() == first.peer_id
    assert peer_id_from_public_key(first.public_key_bytes) == first.peer_id


def test_corrupt_identity_is_an_error_not_a_silent_regeneration(tmp_path):
    path = tmp_path / "peer.key"
    path.write_bytes(b"definitely not a key")
    before = path.read_bytes()
    with pytest.raises(IdentityError, match="corrupt"):
        load_or_create_identity(path)
    assert path.read_bytes() == before


def test_missing_directory_is_an_error(tmp_path):
    with pytest.raises(IdentityError, match="does not exist"):
        load_or_create_identity(tmp_path / "nope" / "peer.key")


def test_ephemeral_identities_differ():
    assert load_or_create_identity(None).peer_id != load_or_create_identity(None).peer_id

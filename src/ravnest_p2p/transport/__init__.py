"""Moving bytes and tensors between peers: identity, the libp2p host, typed RPC, the tensor codec."""

from ravnest_p2p.transport.base import UNARY_LIMIT_BYTES, RawHandler, Transport
from ravnest_p2p.transport.budget import InboundBudget, Lease
from ravnest_p2p.transport.codec import Compression, decode_tensor, encode_tensor
from ravnest_p2p.transport.fake import FakeNetwork, FakeTransport
from ravnest_p2p.transport.identity import Identity, load_or_create_identity, peer_id_from_public_key
from ravnest_p2p.transport.limits import WireLimits
from ravnest_p2p.transport.p2p import HostConfig, P2PTransport
from ravnest_p2p.transport.rpc import CallContext, Reply, RpcEndpoint, RpcMethod

__all__ = [
    "UNARY_LIMIT_BYTES",
    "CallContext",
    "Compression",
    "FakeNetwork",
    "FakeTransport",
    "HostConfig",
    "Identity",
    "InboundBudget",
    "Lease",
    "P2PTransport",
    "RawHandler",
    "Reply",
    "RpcEndpoint",
    "RpcMethod",
    "Transport",
    "WireLimits",
    "decode_tensor",
    "encode_tensor",
    "load_or_create_identity",
    "peer_id_from_public_key",
]

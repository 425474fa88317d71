"""ravnest_p2p: train large models on volunteer computers over hivemind's P2P transport."""

from ravnest_p2p.errors import RavnestError

__all__ = ["RavnestError", "__version__"]

__version__ = "0.1.0"

"""edgetp: one language model across the small computers on a LAN."""

__version__ = "0.1.0"

"""The network: frame codec, TCP links, cluster authentication."""

# Read by discovery and auth too, which a client loads: here, apart from the frame codec's numpy.
# 2: sealed frames after the handshake, HELLO inside the proof; 3: pipeline stages (HIDDEN), a STEP
# carrying decode rows and a prefill chunk together, several rows of one slot (a replay)
PROTOCOL_VERSION = 3
LINK_KEY_BYTES = 32  # a link's ChaCha20-Poly1305 key

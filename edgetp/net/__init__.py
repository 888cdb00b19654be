"""The network: frame codec, TCP links, cluster authentication."""

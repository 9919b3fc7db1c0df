"""The shared-memory transport between ranks of one host (transport.py), its machinery, and the
intra-host algorithms that only make sense on it."""

"""One module per compression algorithm; see ``compression.registry`` for names."""

"""The coordinator's HTTP server: one ``serve`` for root, relay and serve.py, and the buffering front it runs."""

"""The coordinator's HTTP API: the app factory, its blueprints (routes, uploads, relays, placement), OpenAPI, metrics."""

"""Relay coordinators (docs/history/wan.md, "Relays"): a region's workers push and pull through a relay,
which pre-aggregates their updates and forwards one combined update per expert upstream."""

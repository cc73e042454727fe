"""Serve the federation's experts over an OpenAI-compatible HTTP API (docs/serving.md)."""

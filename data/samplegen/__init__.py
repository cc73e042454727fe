"""Generators for FedMoE's sample datasets (run through data/make_samples.py)."""

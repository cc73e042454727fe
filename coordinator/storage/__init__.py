"""Durability: the expert store (blobs and the manifest rows naming them), group commit, resumable-upload files."""

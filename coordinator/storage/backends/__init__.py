"""Storage backends behind the ExpertStore seam: PostgreSQL for the manifest, S3-compatible object stores for blobs.

SQLite and local files (coordinator/storage/manifest.py, coordinator/storage/blobs.py) stay the embedded default; these
let several coordinator processes serve one federation (docs/scale.md).
"""

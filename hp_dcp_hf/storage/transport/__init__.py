"""Transports: where a checkpoint lives and how its bytes travel (local files, fsspec, S3, HTTP), with retries and byte counts."""

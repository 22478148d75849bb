"""Helpers that tests, benchmarks and fault reports share (a local S3 server)."""

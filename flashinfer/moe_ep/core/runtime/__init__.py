"""Process-level runtime: distributed bootstrap and helpers to run ranks locally."""

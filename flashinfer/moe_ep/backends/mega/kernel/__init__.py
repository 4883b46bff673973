"""Kernel backends of the mega mode, per GPU architecture."""

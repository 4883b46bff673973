"""Modes of the EP layer. ``mega``: one fused kernel backend does dispatch, expert MLPs and combine."""

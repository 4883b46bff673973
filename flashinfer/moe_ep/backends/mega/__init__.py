"""Mega-mode backends: a base class (``base.py``), the torch reference, and kernel backends per arch."""

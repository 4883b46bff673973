"""Adaptations between flashinfer.moe_ep and the cutedsl_megamoe kernel drop. Only the shim imports ``src/``."""

"""Core: numerics (activations, formats, the reference MoE math), validation, contracts, runtime.

``core`` is the bottom of the package: everything else may import it, it imports none of
``layer``, ``modes``, ``backends`` or ``kernel_src`` (checked by ``core.layering``).
"""

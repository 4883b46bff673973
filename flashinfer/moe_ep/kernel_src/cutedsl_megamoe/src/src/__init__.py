"""Device-side helpers shared by the kernels of the drop (activations, vector copies)."""

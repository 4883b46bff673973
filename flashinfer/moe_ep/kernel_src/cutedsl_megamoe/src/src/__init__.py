"""Device-side helpers shared by the kernels of the drop (activations, block-scaled formats, symmetric
buffers)."""

"""Constants and host-side helpers shared by the kernels of the drop (no device code here)."""

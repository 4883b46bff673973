"""The mega mode: the backend registry and the layer that drives a backend."""

from .registry import create_mega_kernel, get_mega_backend_class, register_mega_kernel, registered_mega_kernels

__all__ = ["create_mega_kernel", "get_mega_backend_class", "register_mega_kernel", "registered_mega_kernels"]

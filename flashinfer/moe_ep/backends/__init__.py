"""Backends: one package per mode and kernel family. Kernel backends reach a kernel drop only through
the drop package's ``__init__`` (``flashinfer.moe_ep.kernel_src.<drop>``), and only lazily, inside
functions, so that importing a config never imports a drop."""

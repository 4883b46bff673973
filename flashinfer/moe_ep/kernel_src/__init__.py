"""Kernel drops. Each drop is a package: ``__init__`` (the only entry for backends), ``shim/`` (every
adaptation), ``src/`` (the kernel team's code, vendored verbatim and recorded in ``VENDOR.md``)."""

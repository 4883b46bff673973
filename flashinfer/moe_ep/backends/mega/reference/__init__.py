"""The torch reference backend: any device, any world size (EP through torch.distributed all-to-all)."""

from .config import ReferenceMegaMoeConfig

__all__ = ["ReferenceMegaMoeConfig"]

"""SEAM B: the node's block cache. ``base`` holds the contract; ``TieredBlockCache`` is the
implementation over RAM and SSD tier directories with an LMDB block index."""

from cachefs.cache.admission import CacheClosed
from cachefs.cache.opening import ADMISSION_POLICIES
from cachefs.cache.tier import TierConfig
from cachefs.cache.tiered import TieredBlockCache

__all__ = ["ADMISSION_POLICIES", "CacheClosed", "TierConfig", "TieredBlockCache"]

"""cachefs: a RAM/SSD cache in front of object storage, served as a read-only FUSE mount."""

__version__ = "0.1.0"

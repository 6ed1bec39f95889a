"""cachefs: a RAM/SSD cache in front of object storage, served as a read-only FUSE mount."""

__version__ = "0.1.0"
#: The name pip knows this project by (pyproject.toml's [project] name): "cachefs" on the public
#: package index is someone else's project. The import packages keep their names.
DISTRIBUTION_NAME = "cachefs-dl"

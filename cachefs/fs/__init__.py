"""The read-only filesystem: a core with no pyfuse3 import, and a thin pyfuse3 adapter."""

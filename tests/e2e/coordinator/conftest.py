# The in-process coordinator's fixtures, shared with the unit tier (tests/coordinator_model.py).
from tests.coordinator_model import clock, coordinator, state_dir, store  # noqa: F401 (fixtures)

from tests.coordinator_model import clock, coordinator, state_dir, store  # noqa: F401 (fixtures)

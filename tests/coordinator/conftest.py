from tests.coordinator.model import clock, cluster, state_dir, store  # noqa: F401 (fixtures)

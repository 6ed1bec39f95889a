"""The worker's side of the distributed cache: its view of the membership (who owns which
shard), the heartbeat agent that keeps that view and the datasets in step with the coordinator,
and the preloader that fills the shards this node owns."""

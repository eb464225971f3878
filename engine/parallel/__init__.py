"""Tensor parallelism: a model split over ranks (shard.py), their collectives (comm.py), the group the engine drives
as one model (group.py: load_parallel), a GPU rank's process (worker.py)."""

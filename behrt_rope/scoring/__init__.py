"""Fast batch scoring of whole histories: vectorised length-bucketed batches, no autograd, bf16 where the
hardware has it, and the per-shard unit of work shared by the local and the Ray engines of ``predict``."""

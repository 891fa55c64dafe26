"""A training run as one process per rank: the per-rank runtime, the launcher, synthetic runs
and the ``torch.distributed.pipelining`` peer."""

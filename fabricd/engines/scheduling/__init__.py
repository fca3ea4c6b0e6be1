"""MLfabric's scheduler (MLfabric §4, §5.1, §5.2): residual-capacity timelines of a star
network, the order a batch of updates reaches the server (Alg. 1, Alg. 2) and which of them
go through an aggregator (Alg. 3).  Pure computation: time is an argument; see
docs/mlfabric.md."""

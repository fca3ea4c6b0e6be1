"""Ako's partial gradient exchange: the cost model's partition count, and one rank's exchange
(sliding-window accumulation, rotating partitions, staleness clocks, lost peers)."""

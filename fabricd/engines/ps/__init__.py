"""The parameter server (TDF, MLfabric): timed storage, filters, consistency, the push's wire
form, one shard's server, one worker's side, snapshots, and one daemon's models (the node
engine, its routing and held frames, its frames and actions)."""

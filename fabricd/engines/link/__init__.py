"""The peer link's engines: the handshake, the gate for links still in it, and every
peer-link decision (dialling, admission, resets, heartbeats, liveness)."""

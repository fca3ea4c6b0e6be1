"""Point-to-point messaging: the states of a send and a receive, matching, eager messages and
rendezvous."""

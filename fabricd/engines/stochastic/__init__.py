"""Stochastic reduce (ASAP): communication graphs and the NOTIFY-ACK rounds over them."""

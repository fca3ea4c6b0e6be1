"""The services: one per capability, each driving its engine (daemon/service.py is the
contract), and the kit they share (jobs, data queues)."""

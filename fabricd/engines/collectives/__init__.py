"""Persistent collectives (eager-SGD): the algorithms' schedules and one persistent collective
on one node, with solo and majority modes."""

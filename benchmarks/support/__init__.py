"""Processes the suites start beside what they measure (a probe, a fake server):
helpers with a command line of their own, not suites."""

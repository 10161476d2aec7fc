"""Helpers the tests share (imported as `support.<module>`; pytest puts `tests/` on the path):
real servers in subprocesses, the proxy in-process, raw clients, seeded records."""

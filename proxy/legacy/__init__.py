"""The handshake era (2025-06-18 / 2025-11-25): one legacy session machine with an I/O adapter per
upstream kind, and v1 tasks for clients that send `params.task`."""

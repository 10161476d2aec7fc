"""Proxy-owned upstream calls: one call and where it reports (`call`, `types`), the attach / detach /
MRTR runner (`runner`), parked MRTR rounds (`mrtr`), calls backed by an upstream's own v1 tasks
(`upstream_tasks`), and calls sent again after their owner died (`rerun`)."""

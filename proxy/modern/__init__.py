"""The 2026-07-28 era: the per-server method table (`dispatcher`), the proxy's own `tasks/*` methods,
`subscriptions/listen`, and the `Mcp-Param` header index."""

"""Connectors to legacy MCP servers: one `Pool` / `Session` protocol (`types`) with a Streamable HTTP
implementation (`http`, `http_pool`) and a stdio one (`stdio`, `stdio_pool`)."""

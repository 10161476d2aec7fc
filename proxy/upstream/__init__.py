"""Connectors to legacy MCP servers (Streamable HTTP now), one JSON-RPC multiplexer per upstream session."""

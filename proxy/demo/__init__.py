"""Bundled demo legacy (handshake-era) MCP server."""

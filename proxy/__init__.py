"""mcp-tasks-proxy: give legacy MCP servers the MCP Tasks protocol without touching them."""

__version__ = "0.1.0"

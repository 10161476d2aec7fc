"""What faces the client: the listening socket, the MCP endpoint of each server (body, era, reply),
authentication and the principal, the Host/Origin guard, and the front's own middlewares."""

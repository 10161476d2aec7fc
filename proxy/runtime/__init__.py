"""The process around the proxy: logging, the metrics registry, the SIGTERM drain, the event loop,
and the in-process fan-out. The bottom floor: imports nothing from the rest of `proxy/`."""

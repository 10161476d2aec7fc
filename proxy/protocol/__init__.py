"""Pure wire knowledge of the proxy: JSON-RPC envelopes, eras, tasks shapes, result translation. No I/O."""

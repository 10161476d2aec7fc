"""Pure wire knowledge: JSON-RPC envelopes and codes, eras and the 2026-07-28 envelope, upstream
questions, result translation, SSE framing. No I/O, no imports from the rest of `proxy/`."""

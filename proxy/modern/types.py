"""One 2026-07-28 request as the method table and its handlers see it."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.calls.types import Reply
from proxy.protocol.era import Envelope
from proxy.protocol.jsonrpc import JsonObject


@dataclass(frozen=True, slots=True)
class ModernRequest:
    """A validated request: its JSON-RPC `body` and `params` (an object, `{}` when absent), the
    envelope its `_meta` carried, the caller's `principal`, and the `reply` it talks back on."""

    body: JsonObject
    params: JsonObject
    envelope: Envelope
    principal: str
    reply: Reply

    @property
    def method(self) -> str:
        """The JSON-RPC method."""
        return self.body["method"]

"""Replicas: several proxy processes on one shared store, any of them serving any task
(design.md "Where the code goes next" 1; README "Replicas").

The only path to another replica's live state (a running call's cancel or input answers, a
parked MRTR call, a legacy session) is the authenticated replica-to-replica HTTP hop of
`forward`; everything else is read from the shared store.
"""

from proxy.replicas.node import Replicas, advertised_url
from proxy.replicas.registry import Peer, Registry, SharedMap
from proxy.replicas.routing import EndpointRouter, on_response_prepare

__all__ = [
    "EndpointRouter",
    "Peer",
    "Registry",
    "Replicas",
    "SharedMap",
    "advertised_url",
    "on_response_prepare",
]

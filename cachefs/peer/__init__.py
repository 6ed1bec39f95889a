"""Peer block transport: a worker reads a block it lacks from the node that owns the shard.

``server.PeerServer`` is the owner's side, ``client.PeerClient`` the reader's; ``wire`` holds the
protocol's bytes (handshake, request frames, answers), ``stream`` the socket plumbing both share,
``base`` the request and the errors.
"""

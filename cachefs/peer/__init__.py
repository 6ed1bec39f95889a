"""Peer block transport: a worker reads a block it lacks from the node that owns the shard.

``server.create_peer_app`` is the owner's raw ASGI app, ``client.PeerClient`` the reader's side;
``base`` holds what both agree on (the request, its wire encoding, the errors).
"""

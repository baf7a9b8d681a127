"""Cooperative caching: pffs processes on several nodes fetch each block from the backend once between them.

Every block has one owner among the group's members (rendezvous hashing over their addresses, so a member
joining or leaving moves only its own share). A process that misses a block asks its owner first; the owner
serves it from its cache, or fetches it from the backend once (its block cache's single flight) and serves
it. The request names the block exactly as the local cache keys it (the object's identity included), so an
owner never serves bytes of another version; the answer carries the block's checksums, which the receiver
checks before the bytes are used or kept. A peer that fails, answers wrongly or takes longer than the
deadline costs that one request: the block then comes from the backend, and the peer is left alone for a
while. Peers authenticate every request with a shared token (an HMAC of the request and the time: the token
itself never travels); backend credentials never travel at all.

protocol.py   owners, request signing, the block's wire format
server.py     the HTTP listener that serves this process's blocks to members
group.py      the client side: which member owns a block, asking it, falling back
"""

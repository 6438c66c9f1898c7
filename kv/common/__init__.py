"""What the client and the server share, so that neither imports the other: result types
(results.py), argument checks (arguments.py), the JSON wire form of values and transaction
parts (wire.py), client-session request ids and pools (sessions.py), paged scans (scan.py),
the committed-entry stream format (entry_stream.py), a private event loop thread (loop.py)
and client TLS (tls.py). It imports nothing of kv but kv.errors and the pure codecs of
kv.raft and kv.statemachine."""

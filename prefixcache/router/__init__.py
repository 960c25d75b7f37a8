"""A cache-aware router over `prefixcache serve` replicas: each request goes to the replica that holds the longest
cached prefix of it, balanced against load. It keeps no state that the KV event stream and health checks cannot
rebuild, so several routers can run side by side and a router restart loses nothing."""

"""Real service processes for the tests, each on a free loopback port and owned by the test that starts it (the
benchmarks start theirs with the same code)."""
from prefixcache.bench.server import RedisProcess, free_port  # noqa: F401

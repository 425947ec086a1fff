"""``kvstore_node`` starts real kvstore node processes (the device-path tests' nodes)."""

from tests.kvstore.conftest import kvstore_node  # noqa: F401  (the fixture, for every module here)

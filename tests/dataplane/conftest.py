"""The data-plane matrix's fixture: ``kvstore_node`` starts real kvstore node processes."""

from tests.kvstore.conftest import kvstore_node  # noqa: F401  (the fixture, for every module here)

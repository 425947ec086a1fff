"""Moved to ``crescent.services.contract.finish`` (issue 28); this name stays only so branches
written before the move still import. New code imports the contract."""

from crescent.services.contract.finish import stop_token_ids  # noqa: F401

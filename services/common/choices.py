"""Moved to ``crescent.services.contract.choices`` (issue 28); this name stays only so branches
written before the move still import. New code imports the contract."""

from crescent.services.contract.choices import MAX_CHOICES, choice_seed, choices_kv_tokens  # noqa: F401

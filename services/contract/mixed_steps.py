"""How many prompt tokens an aggregated engine mixes into one decode step, unless configured.

The aggregated role takes it as its ``chunk_tokens`` default; the Conductor, which never sees an
instance's settings, assumes it when timing an aggregated instance's prompts
(``SchedulerSettings.aggregated_chunk_tokens``). Kept here so the scheduler needs no role's settings.
"""

from __future__ import annotations

AGGREGATED_CHUNK_TOKENS = 256

"""Live, open-loop replay of a Mooncake-format trace against any OpenAI-compatible server.

Each 512-token hash id becomes a fixed block of ``--tokens-per-block`` words derived from the id
(equal ids give equal text, so requests share prefixes exactly as in the trace); a prompt is the
concatenation of its blocks, the last one trimmed to the scaled input length. Output lengths are
divided by ``--output-scale`` and generated with ``ignore_eos``; arrival times are multiplied by
``--time-scale`` (< 1 compresses them: more load), or set by ``--rate`` (requests/s). Requests are
sent at their arrival time whatever the server is doing (open loop).

  python -m loadtest.replay --url http://127.0.0.1:8000 --max-requests 100 --rate 0.2
  python -m loadtest.replay --sweep --target crescent=http://127.0.0.1:8000 \\
      --target vllm=http://127.0.0.1:8100 --rates 0.2,0.4,0.8 --png sweep.png

Reports completed/failed, rejections by status and reason, TTFT and TBT percentiles (TBT per
Mooncake: the mean of a request's longest 10% inter-token intervals), SLO attainment, effective
request capacity (the share of *all* requests meeting both SLOs) and the cached fraction the server
reports (usage.prompt_tokens_details.cached_tokens) next to the trace's theoretical maximum.
"""

from loadtest.replay.cli import main, plot_sweep, print_report
from loadtest.replay.prompts import (
    WORDS,
    block_text,
    build_prompt,
    native_rate,
    parse_reason,
    percentile,
    scaled_input_words,
    scaled_output,
    theoretical_cached_fraction,
    time_scale_for_rate,
)
from loadtest.replay.run import Outcome, ReplayConfig, replay, summarize

__all__ = [
    "WORDS", "Outcome", "ReplayConfig", "block_text", "build_prompt", "main", "native_rate", "parse_reason", "percentile",
    "plot_sweep", "print_report", "replay", "scaled_input_words", "scaled_output", "summarize",
    "theoretical_cached_fraction", "time_scale_for_rate",
]

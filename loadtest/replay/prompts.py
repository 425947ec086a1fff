"""The pure parts of a replay: a trace block's text, scaling, the trace's prefix-cache bound,
percentiles and rejection reasons."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

from loadtest.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest

# Common short English words: each is one token with its leading space in GPT-2-style BPE
# vocabularies, so a block of N words is about N tokens and block boundaries are token boundaries.
WORDS = tuple(
    """the of and to in is was for on are with as his they be at one have this from or had by
    word but what some we can out other were all there when up use your how said an each she which
    do their time if will way about many then them write would like so these her long make thing see
    him two has look more day could go come did number sound no most people my over know water than
    call first who may down side been now find any new work part take get place made live where after
    back little only round man year came show every good me give our under name very through just form
    great think say help low line turn cause much mean before move right boy old too same tell does set
    three want air well also play small end put home read hand port large spell add even land here must
    big high such follow act why ask men change went light kind off need house picture try us again
    animal point mother world near build self earth father head stand own page should country found
    answer school grow study still learn plant cover food sun four thought let keep eye never last door
    between city tree cross since hard start might story saw far sea draw left late run while press close
    night real life few stop open seem together next white children begin got walk example ease paper
    often always music those both mark book letter until mile river car feet care second group carry
    took rain eat room friend began idea fish mountain north once base hear horse cut sure watch color
    face wood main enough plain girl usual young ready above ever red list though feel talk bird soon
    body dog family direct pose leave song measure state product black short numeral class wind question
    happen complete ship area half rock order fire south problem piece told knew pass farm top whole king
    size heard best hour better true during hundred am remember step early hold west ground interest reach
    fast five sing listen six table travel less morning ten simple several vowel toward war lay against
    pattern slow center love person money serve appear road map science rule govern pull cold notice
    voice fall power town fine certain fly unit lead cry dark machine note wait plan figure star box noun
    field rest correct able pound done beauty drive stood contain front teach week final gave green quick
    develop sleep warm free minute strong special mind behind clear tail produce fact street inch lot
    nothing course stay wheel full force blue object decide surface deep moon island foot yet busy test
    record boat common gold possible plane age dry wonder laugh thousand ago ran check game shape yes hot
    miss brought heat snow bed bring sit perhaps fill east weight language among""".split()
)
REASON = re.compile(r"\(([A-Za-z0-9_.-]+)\)")


# ---------------------------------------------------------------- the pure parts: text and scaling
def block_text(hash_id: int, words: int, seed: int = 0) -> str:
    """The fixed text of one trace block: ``words`` words, each with its leading space."""
    rng = random.Random(f"crescent-replay:{seed}:{hash_id}")
    return "".join(" " + rng.choice(WORDS) for _ in range(words))


def scaled_input_words(req: TraceRequest, tokens_per_block: int) -> int:
    """The trace's input length in words at ``tokens_per_block`` per 512-token block (≥ 1)."""
    n = max(1, math.ceil(req.input_length * tokens_per_block / TRACE_BLOCK_TOKENS))
    return min(n, len(req.hash_ids) * tokens_per_block) if req.hash_ids else n


def build_prompt(req: TraceRequest, tokens_per_block: int, seed: int = 0) -> str:
    """The concatenation of the request's blocks, the last trimmed to the scaled input length."""
    want = scaled_input_words(req, tokens_per_block)
    if not req.hash_ids:  # a trace without block ids: unique text
        return block_text(-1 - req.index, want, seed)
    parts, left = [], want
    for hid in req.hash_ids:
        if left <= 0:
            break
        n = min(tokens_per_block, left)
        text = block_text(hid, tokens_per_block, seed)
        parts.append(text if n == tokens_per_block else "".join(" " + w for w in text.split()[:n]))
        left -= n
    return "".join(parts).lstrip()


def scaled_output(req: TraceRequest, output_scale: float) -> int:
    return max(1, round(req.output_length / output_scale))


def native_rate(trace: Sequence[TraceRequest]) -> float:
    """Requests per second of the trace as recorded (n-1 gaps over its span)."""
    if len(trace) < 2:
        return 0.0
    span = trace[-1].arrival_s - trace[0].arrival_s
    return (len(trace) - 1) / span if span > 0 else math.inf


def time_scale_for_rate(trace: Sequence[TraceRequest], rate: float) -> float:
    nr = native_rate(trace)
    return nr / rate if nr not in (0.0, math.inf) else 1.0


def theoretical_cached_fraction(trace: Sequence[TraceRequest], tokens_per_block: int) -> dict:
    """Upper bound on prefix caching for these requests in this order: blocks (and scaled tokens)
    whose hash id an earlier request already sent, over all blocks (tokens)."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for req in trace:
        left = scaled_input_words(req, tokens_per_block)
        for hid in req.hash_ids:
            if left <= 0:
                break
            n = min(tokens_per_block, left)
            blocks += 1
            tokens += n
            if hid in seen:
                hit_blocks += 1
                hit_tokens += n
            left -= n
        seen.update(req.hash_ids)
    return {"blocks": hit_blocks / blocks if blocks else 0.0, "tokens": hit_tokens / tokens if tokens else 0.0}


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear-interpolation percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_reason(message: str) -> str:
    """Crescent puts the reason in parentheses: 'rejected by the scheduler (ttft_slo): ...'."""
    m = REASON.search(message or "")
    return m.group(1) if m else "other"

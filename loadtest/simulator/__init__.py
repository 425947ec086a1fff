"""A discrete-event simulator of a Crescent cluster, driven by Mooncake-format traces.

It runs the scheduling core of ``crescent.services.scheduler`` unchanged (policies, cost
models, prefix index) against simulated prefill and decode instances.
"""

from loadtest.simulator.report import SimOutcome, Summary, summarize
from loadtest.simulator.sim import SimConfig, Simulation, simulate
from loadtest.simulator.trace import TraceRequest, load_trace, rescale

__all__ = [
    "SimOutcome", "SimConfig", "Simulation", "Summary", "TraceRequest", "load_trace", "rescale", "simulate", "summarize",
]

"""Rate limits and spend budgets: settings, the counter stores (in-process, Redis), the limiter,
its HTTP middleware and admin API."""

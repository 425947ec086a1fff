"""Logging set-up shared by every service: one line per record, with the request id."""

from __future__ import annotations

import contextvars
import logging
import os

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger for a service process (idempotent)."""
    level = (level or os.environ.get("CRESCENT_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service} [%(request_id)s] %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)

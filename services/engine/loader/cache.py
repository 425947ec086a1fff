"""A disk cache of dequantized GGUF loads, so every process after the first maps float32 weights.

An entry is a float32 Hugging Face directory (see ``export``) plus ``source.json``, under
``$CRESCENT_CACHE_DIR/weights/<key>`` (default ``~/.cache/crescent``). The key hashes the GGUF's
resolved path, size and mtime and the cache format, so a changed file or loader misses. Entries
are written to a temporary directory and renamed into place: readers never see half an entry.
A broken entry is a miss (logged), never an error: the cache is only a cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from crescent.services.engine.loader.errors import ModelLoadError
from crescent.services.engine.loader.export import export_hf_dir
from crescent.services.engine.loader.hf_loader import load_hf_dir
from crescent.services.engine.loader.loaded import LoadedModel

logger = logging.getLogger(__name__)

# Bump whenever the loader's output for the same GGUF changes (names, Q/K layout, dtype).
CACHE_FORMAT = 2
SOURCE_FILE = "source.json"


def cache_root() -> Path:
    return Path(os.environ.get("CRESCENT_CACHE_DIR") or "~/.cache/crescent").expanduser()


def _source_facts(gguf_path: Path) -> dict[str, object]:
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    return {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": CACHE_FORMAT}


def entry_dir(gguf_path: Path) -> Path:
    """Where the cache entry for this exact GGUF file lives (whether or not it exists)."""
    facts = json.dumps(_source_facts(gguf_path), sort_keys=True)
    return cache_root() / "weights" / hashlib.sha256(facts.encode()).hexdigest()[:32]


def load_cached(gguf_path: Path, model_id: str) -> LoadedModel | None:
    entry = entry_dir(gguf_path)
    try:
        if json.loads((entry / SOURCE_FILE).read_text()) != _source_facts(gguf_path):
            return None
    except (OSError, ValueError):
        return None  # no entry (the usual miss) or an unreadable one
    try:
        loaded = load_hf_dir(entry, model_id, progress=False)
    except ModelLoadError as exc:
        logger.warning("weight cache entry %s is unusable (%s); reloading the GGUF", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    logger.info("loaded %s from weight cache %s", model_id, entry)
    return loaded


def store(gguf_path: Path, loaded: LoadedModel) -> None:
    """Write the entry atomically; failures (read-only or full disk) are logged and ignored."""
    entry = entry_dir(gguf_path)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        export_hf_dir(loaded, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(_source_facts(gguf_path), sort_keys=True))
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / SOURCE_FILE).is_file():
                raise
            logger.info("weight cache entry %s was written by another process", entry)
    except OSError as exc:
        logger.warning("could not write weight cache entry %s: %s", entry, exc)
        return
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune_stale(entry, str(gguf_path.resolve()))


def _prune_stale(keep: Path, resolved_path: str) -> None:
    """Remove older entries of the same file (it changed, or the cache format did)."""
    for other in keep.parent.iterdir():
        if other == keep or other.name.startswith(".tmp-"):
            continue
        try:
            if json.loads((other / SOURCE_FILE).read_text()).get("path") == resolved_path:
                shutil.rmtree(other, ignore_errors=True)
                logger.info("removed stale weight cache entry %s", other)
        except (OSError, ValueError, AttributeError):
            continue

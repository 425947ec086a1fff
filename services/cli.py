"""The ``crescent`` command: run the whole platform, or one service as a container would."""

from __future__ import annotations

import importlib
import logging
import signal
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.text import Text

from crescent.services.contract.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.common.settings import SettingsError
from crescent.services.keys_cli import auth_status, keys_app
from crescent.services.plan.cli import plan_command
from crescent.services.usage_cli import usage_command
from crescent.services.model.model_source import DEFAULT_MODEL

if TYPE_CHECKING:
    from crescent.services.launcher import SupervisionEvent

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Crescent: LLM serving built around the KV cache.")
console = Console(stderr=True)
log = logging.getLogger(__name__)
app.add_typer(keys_app, name="keys")
app.command("usage")(usage_command)
app.command("plan")(plan_command)


class EngineBackend(str, Enum):
    native = "native"
    vllm = "vllm"


class EngineDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class KvCacheDtype(str, Enum):  # EngineSettings.kv_cache_dtype's values (a test keeps the two equal)
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8 = "fp8"


DEVICE_HELP = "native engines: where they compute, cpu, cuda or cuda:N (engine.device; docs/cuda.md)"
DTYPE_HELP = ("native engines: weights' and activations' dtype (engine.dtype): auto is the checkpoint's on CUDA, "
              "float32 on the CPU")
KV_CACHE_DTYPE_HELP = ("native engines: the paged KV cache's dtype (engine.kv_cache_dtype): auto is the engines' "
                       "dtype; fp8 for kimi_k3 models only")


class Service(str, Enum):
    gateway = "gateway"
    scheduler = "scheduler"
    prefill = "prefill"
    decode = "decode"
    aggregated = "aggregated"
    kvstore = "kvstore"
    # The other ranks of a tensor-parallel engine group (a LeaderWorkerSet's worker pods): they read
    # the role's settings, hold a shard of the model and follow the leader (services/engine/parallel).
    prefill_worker = "prefill-worker"
    decode_worker = "decode-worker"
    aggregated_worker = "aggregated-worker"


@app.command()
def serve(
    service: Annotated[Service, typer.Argument(help="which service this process runs")],
    config: Annotated[Path | None, typer.Option(help="YAML settings; env vars CRESCENT_<SERVICE>__... override")] = None,
) -> None:
    """Run one service in the foreground until SIGTERM (what a container runs)."""
    try:
        if service.value.endswith("-worker"):
            from crescent.services.engine.parallel import worker

            worker.main(service.value.removesuffix("-worker"), config)
            return
        module = importlib.import_module(f"crescent.services.{service.value}.server")
        module.main(config)
    except SettingsError as exc:
        say((f"crescent serve {service.value}:", "red"), f" {exc}")
        raise typer.Exit(2) from None


def say(*parts: str | tuple[str, str]) -> None:
    """Print one line to the operator: plain strings, or (text, style) pairs. Text objects, never
    markup, so a log line with ``[...]`` in it prints as it is; a terminal that went away is
    logged, never raised (the launcher must outlive whatever it prints)."""
    line = Text.assemble(*parts)
    try:
        console.print(line)
    except Exception:  # noqa: BLE001 - printing must never stop the supervisor
        log.exception("cannot print to the console: %s", line.plain)


def report(event: SupervisionEvent) -> None:
    styles = {"crashed": "red", "exited": "yellow", "restart_failed": "red", "restarted": "yellow", "ready": "green"}
    say((f"{event.name} {event.kind.replace('_', ' ')}", f"bold {styles.get(event.kind, '')}".strip()),
        f": {event.detail}")
    for line in event.log_tail:
        say(("    | ", "dim"), line)


@app.command()
def up(
    model: Annotated[str, typer.Option(help="preset name, .gguf file or Hugging Face directory")] = DEFAULT_MODEL,
    prefill: Annotated[int, typer.Option(min=1, help="prefill instances")] = 1,
    decode: Annotated[int, typer.Option(min=1, help="decode instances")] = 1,
    aggregated: Annotated[int | None, typer.Option(
        min=0, help="aggregated instances (prefill and decode in one process) instead of the two pools "
                    "(default: 0, the pools; with --engine vllm: 1)", show_default=False)] = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="gateway HTTP port")] = 8000,
    host: Annotated[str, typer.Option(help="address every service listens on")] = "127.0.0.1",
    kv_capacity_tokens: Annotated[int, typer.Option(min=64, help="paged KV cache per engine instance")] = 32768,
    kvstore_gb: Annotated[float, typer.Option(min=0.0, help="host-memory tier of the kvstore, GB")] = 4.0,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = DEFAULT_BLOCK_SIZE,
    ttft_slo: Annotated[float | None, typer.Option(help="seconds; requests predicted to miss it get 429")] = None,
    drain_grace: Annotated[float, typer.Option(min=0.0, help="seconds in-flight requests may finish on Ctrl-C")] = 30.0,
    run_dir: Annotated[Path | None, typer.Option(help="configs, logs and services.json; default: a temp dir")] = None,
    ready_timeout: Annotated[float | None, typer.Option(
        help="seconds to wait for every service (default: 600; with --engine vllm: 900)", show_default=False)] = None,
    tls: Annotated[bool, typer.Option(help="mutual TLS between the services (--no-tls: plaintext, loopback only)")] = True,
    allow_unauthenticated_network: Annotated[bool, typer.Option(
        help="with --host other than loopback: serve keyless anyway (everyone who reaches it is the default "
             "tenant; a network you trust only)")] = False,
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    dtype: Annotated[EngineDtype, typer.Option(help=DTYPE_HELP)] = EngineDtype.auto,
    kv_cache_dtype: Annotated[KvCacheDtype, typer.Option(help=KV_CACHE_DTYPE_HELP)] = KvCacheDtype.auto,
    engine: Annotated[EngineBackend, typer.Option(
        help="what computes in the engines: Crescent's own engine, or vLLM's CPU build (its own venv, "
             "`make install-vllm`; one aggregated instance unless --aggregated 0 asks for the pools)")] = EngineBackend.native,
) -> None:
    """Start all five services as separate processes and keep them running (a crashed one is
    restarted with backoff); drain and stop them all on Ctrl-C or SIGTERM (twice: at once)."""
    from crescent.services.engine.device import DeviceSettingError
    from crescent.services.engine_vllm.interpreter import VllmNotInstalledError
    from crescent.services.launcher import (
        READY_TIMEOUT_S, LaunchError, PlanError, Platform, PlatformPlan, StopRequested, check_engine_settings,
    )
    from crescent.services.model.model_source import ModelSpecError

    backend = engine.value
    if aggregated is None:
        aggregated = 1 if backend == "vllm" else 0
    if ready_timeout is None:
        ready_timeout = READY_TIMEOUT_S[backend]
    try:  # a plan that cannot run, or no vLLM to run it, is said before anything starts
        plan = PlatformPlan(model, host, port, prefill, decode, kv_capacity_tokens, int(kvstore_gb * 1e9),
                            block_size, ttft_slo, drain_grace, tls, aggregated=aggregated, backend=backend,
                            unauthenticated_network=allow_unauthenticated_network, device=device, dtype=dtype.value,
                            kv_cache_dtype=kv_cache_dtype.value)
        check_engine_settings(plan)  # a GPU this machine lacks is said once, here, not by every engine's crash loop
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="crescent-"))
        platform = Platform(plan, run_dir)
    except (PlanError, VllmNotInstalledError, DeviceSettingError, ModelSpecError) as exc:
        say(("crescent up:", "red"), f" {exc}")
        raise typer.Exit(2) from None

    def on_signal(signum: int, _frame: object) -> None:
        platform.request_stop()  # the loops below notice within a fraction of a second

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engines = f"{aggregated} aggregated" if aggregated else f"{prefill} prefill, {decode} decode"
    if backend == "vllm":
        engines += f" on vLLM (first start takes minutes; waiting up to {ready_timeout:.0f} s)"
    say(f"Starting Crescent ({model}: {engines}); logs in {run_dir}")
    failed = False
    try:
        platform.start()
        with console.status("waiting for services…") as status:
            ready: list[str] = []

            def note(name: str) -> None:
                ready.append(name)
                status.update(Text(f"ready: {', '.join(ready)}"))
                say(("  ✓ ", "green"), name)

            platform.wait_ready(ready_timeout, note)
        url = f"http://{host}:{port}"
        say("\n", ("Crescent is up: ", "bold"), f"{url}/v1  (services: {run_dir / 'services.json'})")
        say(
            f"Try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{Path(model).stem if '/' in model else model}\", "
            f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
            "Press Ctrl-C to stop."
        )
        say(*auth_status())
        while not platform.stop_requested:
            for event in platform.supervise():
                report(event)
            time.sleep(0.25)
    except StopRequested:
        pass
    except LaunchError as exc:
        say((str(exc), "red"))
        failed = True
    finally:
        say(f"\nStopping (in-flight requests get up to {drain_grace:.0f} s; Ctrl-C again to kill now)…")
        platform.stop()
    say("All services stopped.")
    if failed:
        raise typer.Exit(1)


@app.command()
def certs(
    directory: Annotated[Path, typer.Argument(help="holds ca.pem and ca-key.pem (made here if absent) and the new files")],
    role: Annotated[str, typer.Argument(help="gateway, scheduler, prefill, decode, kvstore, admin or proxy (the Gateway API proxy that asks the endpoint picker)")],
    name: Annotated[str, typer.Option(help="instance id the holder registers as (empty: any of its role)")] = "",
    host: Annotated[list[str] | None, typer.Option(help="DNS name or IP servers are dialled by (repeat; default: loopback)")] = None,
    days: Annotated[int, typer.Option(min=1, help="validity of the certificate (and of a new CA)")] = 365,
) -> None:
    """Issue a mutual-TLS certificate for one role (docs/security.md), from the CA in DIRECTORY."""
    from crescent.services.common.certs import LOCAL_HOSTS, ROLES, CertificateAuthority, make_pki

    if role not in ROLES:
        say((f"unknown role {role!r};", "red"), f" roles are {', '.join(ROLES)}")
        raise typer.Exit(2)
    ca = None
    if (directory / "ca-key.pem").exists():
        ca = CertificateAuthority.load(directory / "ca.pem", directory / "ca-key.pem")
    issued = make_pki(directory, [(role, name)], hosts=host or LOCAL_HOSTS, ca=ca, days=days)[(role, name)]
    say(f"{'issued by the CA in' if ca else 'new CA and certificate in'} {directory}:")
    sys.stdout.write(f"tls:\n  ca: {issued.ca}\n  cert: {issued.cert}\n  key: {issued.key}\n")


@app.command()
def profile(
    model: Annotated[str, typer.Option(help="preset name, .gguf file or Hugging Face directory")] = DEFAULT_MODEL,
    out: Annotated[Path | None, typer.Option(help="write the YAML snippet here; default: print it on stdout")] = None,
    quick: Annotated[bool, typer.Option(help="a few small points (seconds): a smoke test, not a calibration")] = False,
    threads: Annotated[int, typer.Option(min=0, help="torch threads for every role; 0: as crescent up shares this machine's cores")] = 0,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = DEFAULT_BLOCK_SIZE,
    mode: Annotated[str, typer.Option(help="pools (prefill + decode), aggregated (mixed steps) or both")] = "both",
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "cpu",
    dtype: Annotated[EngineDtype, typer.Option(help=DTYPE_HELP)] = EngineDtype.auto,
    kv_cache_dtype: Annotated[KvCacheDtype, typer.Option(help=KV_CACHE_DTYPE_HELP)] = KvCacheDtype.auto,
) -> None:
    """Measure prefill, decode and mixed-step times of the engine here and fit the scheduler's cost models."""
    import platform as host

    from rich.progress import Progress
    from rich.table import Table

    from crescent.services.instance.runtime import build_engine
    from crescent.services.engine.device import DeviceSettingError, resolve_device
    from crescent.services.engine.settings import EngineSettings
    from crescent.services.model.model_source import ModelSpecError
    from crescent.services.cpu_share import available_cores, share_cores
    from crescent.services.profile import (
        DEFAULT_PLAN, MODES, QUICK_PLAN, ProfileThreads, cost_settings_yaml, engine_placement, fit_error, run_profile,
        table_rows,
    )

    if mode not in (*MODES, "both"):
        say((f"unknown mode {mode!r};", "red"), f" choose {', '.join(MODES)} or both")
        raise typer.Exit(2)
    modes = MODES if mode == "both" else (mode,)
    plan = QUICK_PLAN if quick else DEFAULT_PLAN
    if threads:
        roles = ProfileThreads(prefill=threads, decode=threads, aggregated=threads)
    else:  # what crescent up gives each engine: 1 prefill + 1 decode, or 1 aggregated engine
        cores = available_cores()
        pools, alone = share_cores(cores, 1, 1), share_cores(cores, 1, 0)
        # Pools sharing too few cores: prefill also timed on the threads decode leaves it.
        beside = max(1, cores - pools.decode) if pools.prefill_passive else 0
        roles = ProfileThreads(prefill=pools.prefill, decode=pools.decode, aggregated=alone.threads("aggregated"),
                               prefill_beside_decode=beside if beside != pools.prefill else 0)
    try:  # the engine's own checks (build_engine's run before the model loads), said as crescent up says them
        resolve_device(device)
        with console.status(f"loading {model}…"):
            # min_cached_prompt_tokens 0: the profile's short prefixes must stay cached to time prefix hits
            engine = build_engine(EngineSettings(
                model=model, threads=max(roles.prefill, roles.decode, roles.aggregated), block_size=block_size,
                kv_capacity_tokens=plan.kv_tokens_needed(block_size), min_cached_prompt_tokens=0, device=device,
                dtype=dtype.value, kv_cache_dtype=kv_cache_dtype.value), progress=False)
    except (DeviceSettingError, ModelSpecError) as exc:
        say(("crescent profile:", "red"), f" {exc}")
        raise typer.Exit(2) from None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("profiling", total=plan.points_for(modes, roles))

        def advance(what: str) -> None:
            progress.update(task, description=what)
            progress.advance(task)

        result = run_profile(engine, plan, on_point=advance, modes=modes, threads=roles)
    table = Table(title=f"{engine.model_id}: measured vs fitted")
    for column in ("kind", "point", "measured s", "fitted s"):
        table.add_column(column, justify="left" if column in ("kind", "point") else "right")
    rows = table_rows(result)
    for kind, point, measured, fitted in rows:
        table.add_row(kind, point, f"{measured:.4f}", f"{fitted:.4f}")
    console.print(table)
    console.print(f"largest fit error: {fit_error(rows):.0%}")
    beside_note = [f"prefill beside decode {roles.prefill_beside_decode}"] if roles.prefill_beside_decode else []
    measured = (([f"prefill {roles.prefill} threads", *beside_note, f"decode {roles.decode}"] if "pools" in modes else [])
                + ([f"mixed steps (aggregated) {roles.aggregated}"] if "aggregated" in modes else []))
    header = (f"crescent profile{' --quick' if quick else ''}: {engine.model_id}, {', '.join(measured)}, "
              f"block size {block_size}, {engine_placement(engine)}, on {host.node()} ({host.machine()}) "
              f"at {time.strftime('%Y-%m-%d %H:%M')}\n"
              + ("prefill/decode: derived from the mixed-step fit (aggregated only)\n" if "pools" not in modes else "")
              + "scheduler settings: put this under the scheduler's config (or merge its cost: section);\n"
              "loadtest/sim_vs_live.py --costs reads it as it is")
    snippet = cost_settings_yaml(result, header)
    if out is None:
        sys.stdout.write(snippet)
    else:
        out.write_text(snippet)
        console.print(f"wrote {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())

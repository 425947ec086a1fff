"""The ``crescent`` command: run the whole platform, or one service as a container would."""

from __future__ import annotations

import importlib
import signal
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from crescent.services.common.block_keys import DEFAULT_BLOCK_SIZE
from crescent.services.common.settings import SettingsError
from crescent.services.engine.model_source import DEFAULT_MODEL

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Crescent: LLM serving built around the KV cache.")
console = Console(stderr=True)


class Service(str, Enum):
    gateway = "gateway"
    scheduler = "scheduler"
    prefill = "prefill"
    decode = "decode"
    kvstore = "kvstore"


@app.command()
def serve(
    service: Annotated[Service, typer.Argument(help="which service this process runs")],
    config: Annotated[Path | None, typer.Option(help="YAML settings; env vars CRESCENT_<SERVICE>__... override")] = None,
) -> None:
    """Run one service in the foreground until SIGTERM (what a container runs)."""
    module = importlib.import_module(f"crescent.services.{service.value}.server")
    try:
        module.main(config)
    except SettingsError as exc:
        console.print(f"[red]crescent serve {service.value}:[/] {exc}")
        raise typer.Exit(2) from None


@app.command()
def up(
    model: Annotated[str, typer.Option(help="preset name, .gguf file or Hugging Face directory")] = DEFAULT_MODEL,
    prefill: Annotated[int, typer.Option(min=1, help="prefill instances")] = 1,
    decode: Annotated[int, typer.Option(min=1, help="decode instances")] = 1,
    port: Annotated[int, typer.Option(min=1, max=65535, help="gateway HTTP port")] = 8000,
    host: Annotated[str, typer.Option(help="address every service listens on")] = "127.0.0.1",
    kv_capacity_tokens: Annotated[int, typer.Option(min=64, help="paged KV cache per engine instance")] = 32768,
    kvstore_gb: Annotated[float, typer.Option(min=0.0, help="host-memory tier of the kvstore, GB")] = 4.0,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = DEFAULT_BLOCK_SIZE,
    ttft_slo: Annotated[float | None, typer.Option(help="seconds; requests predicted to miss it get 429")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="configs, logs and services.json; default: a temp dir")] = None,
    ready_timeout: Annotated[float, typer.Option(help="seconds to wait for every service")] = 600.0,
) -> None:
    """Start all five services as separate processes; stop them all on Ctrl-C or SIGTERM."""
    from crescent.services.launcher import LaunchError, Platform, PlatformPlan

    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="crescent-"))
    plan = PlatformPlan(model, host, port, prefill, decode, kv_capacity_tokens, int(kvstore_gb * 1e9), block_size,
                        ttft_slo)
    platform = Platform(plan, run_dir)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    console.print(f"Starting Crescent ({model}: {prefill} prefill, {decode} decode); logs in {run_dir}")
    try:
        platform.start()
        with console.status("waiting for services…") as status:
            ready: list[str] = []

            def note(name: str) -> None:
                ready.append(name)
                status.update(f"ready: {', '.join(ready)}")
                console.print(f"  [green]✓[/] {name}")

            platform.wait_ready(ready_timeout, note)
        url = f"http://{host}:{port}"
        console.print(f"\n[bold]Crescent is up:[/] {url}/v1  (services: {run_dir / 'services.json'})")
        console.print(
            f"Try:\n  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{Path(model).stem if '/' in model else model}\", "
            f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'\n"
            "Press Ctrl-C to stop."
        )
        while True:
            platform.check_alive()
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("\nStopping…")
    except LaunchError as exc:
        console.print(f"[red]{exc}[/]")
        platform.stop()
        raise typer.Exit(1) from None
    finally:
        platform.stop()
    console.print("All services stopped.")


@app.command()
def profile(
    model: Annotated[str, typer.Option(help="preset name, .gguf file or Hugging Face directory")] = DEFAULT_MODEL,
    out: Annotated[Path | None, typer.Option(help="write the YAML snippet here; default: print it on stdout")] = None,
    quick: Annotated[bool, typer.Option(help="a few small points (seconds): a smoke test, not a calibration")] = False,
    threads: Annotated[int, typer.Option(min=1, help="torch threads, as the engine will serve")] = 2,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = DEFAULT_BLOCK_SIZE,
) -> None:
    """Measure prefill and decode times of the engine here and fit the scheduler's cost models."""
    import platform as host

    from rich.progress import Progress
    from rich.table import Table

    from crescent.services.engine.runtime import build_engine
    from crescent.services.engine.settings import EngineSettings
    from crescent.services.profile import DEFAULT_PLAN, QUICK_PLAN, cost_settings_yaml, fit_error, run_profile, table_rows

    plan = QUICK_PLAN if quick else DEFAULT_PLAN
    with console.status(f"loading {model}…"):
        engine = build_engine(EngineSettings(model=model, threads=threads, block_size=block_size,
                                             kv_capacity_tokens=plan.kv_tokens_needed(block_size)), progress=False)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("profiling", total=plan.points)

        def advance(what: str) -> None:
            progress.update(task, description=what)
            progress.advance(task)

        result = run_profile(engine, plan, on_point=advance)
    table = Table(title=f"{engine.model_id}: measured vs fitted")
    for column in ("kind", "point", "measured s", "fitted s"):
        table.add_column(column, justify="left" if column in ("kind", "point") else "right")
    rows = table_rows(result)
    for kind, point, measured, fitted in rows:
        table.add_row(kind, point, f"{measured:.4f}", f"{fitted:.4f}")
    console.print(table)
    console.print(f"largest fit error: {fit_error(rows):.0%}")
    header = (f"crescent profile{' --quick' if quick else ''}: {engine.model_id}, {threads} threads, "
              f"block size {block_size}, on {host.node()} ({host.machine()}) at {time.strftime('%Y-%m-%d %H:%M')}\n"
              "scheduler settings: put this under the scheduler's config (or merge its cost: section)")
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

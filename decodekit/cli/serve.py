"""`decodekit serve RECIPE`: the recipe behind OpenAI's HTTP API (`decodekit.serve`), in this process or as a Ray
Serve deployment of replicas (`--ray`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from decodekit.api.errors import DecodeKitError
from decodekit.cli import terminal
from decodekit.cli.context import load_context


def serve(
    recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE", help="A recipe file: the model, engine limits and "
                                                "every request's defaults (see docs/serving.md).")],
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(envvar="DECODEKIT_API_KEY", show_default=False,
                                                help="Require `Authorization: Bearer KEY` on /v1/* (401 "
                                                "otherwise); /health and /metrics stay open.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Another name the model answers to (listed first "
                                                          "by /v1/models).")] = None,
    max_waiting: Annotated[int | None, typer.Option(min=1, help="Answer 429 while this many requests wait to "
                                                    "start (default: no bound).")] = None,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="Answer 413 to larger request bodies.")] = 4 << 20,
    strict_fields: Annotated[bool, typer.Option("--strict-fields", help="Refuse (400) every request field this "
                                                "server does not know; by default one that is not a typo of a known "
                                                "field is accepted, logged and named in the "
                                                "X-Decodekit-Ignored-Fields response header.")] = False,
    tool_format: Annotated[str, typer.Option(help="The tool-call format requests with tools are served in (a "
                                             "registered tool format; `decodekit plugins` lists them); auto: the "
                                             "one whose call marker the model's chat template holds, else "
                                             "json.")] = "auto",
    vllm_metrics: Annotated[bool, typer.Option("--vllm-metrics", help="Also export /metrics under vLLM's names "
                                               "(vllm:..., with a model_name label), for dashboards built for "
                                               "vLLM.")] = False,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe key: key.path=value "
                                                        "(repeatable).")] = None,
    tensor_parallel: Annotated[int | None, typer.Option(
        "--tensor-parallel", min=1, help="Split the model over this many processes on this machine (the recipe's "
        "engine.tensor_parallel_size; gloo on CPUs, NCCL on GPUs); the heads must divide by it.")] = None,
    tensor_parallel_backend: Annotated[str | None, typer.Option(
        "--tensor-parallel-backend", help="With --tensor-parallel: how the other ranks start: mp (processes on this "
        "machine) or ray (Ray actors in a placement group, across the cluster's machines; needs decodekit[ray]).")
    ] = None,
    use_ray: Annotated[bool, typer.Option("--ray", help="Serve as a Ray Serve deployment of replicas, each with "
                                          "its own engine (needs decodekit[ray]).")] = False,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: the cluster to join (`auto`, "
                                                    "`ray://host:10001`); default: RAY_ADDRESS, else a local "
                                                    "cluster.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="With --ray: replicas (a fixed number).")] = 1,
    min_replicas: Annotated[int, typer.Option(min=0, help="With --ray and --max-replicas: the fewest replicas.")
                            ] = 1,
    max_replicas: Annotated[int | None, typer.Option(min=1, help="With --ray: autoscale between --min-replicas and "
                                                     "this, by requests in flight.")] = None,
    target_ongoing_requests: Annotated[float, typer.Option(min=0.1, help="With --max-replicas: requests in flight "
                                                           "per replica that autoscaling aims at.")] = 32.0,
    cpus_per_replica: Annotated[int, typer.Option(min=1, help="With --ray: CPUs (and torch threads) per replica.")
                                ] = 1,
) -> None:
    """Serve a recipe over HTTP with OpenAI's API: POST /v1/chat/completions and /v1/completions (streaming,
    logprobs, JSON schemas, beam search and speculative decoding through extra fields), GET /v1/models, /health,
    /metrics. SIGTERM or Ctrl-C lets the requests in flight finish, then exits. With --ray, the same app runs as
    a Ray Serve deployment of --replicas replicas (or autoscaled up to --max-replicas) behind Ray's HTTP proxy."""
    terminal.setup_logging(False)
    from decodekit.api.startup_heap import freeze_startup_heap
    from decodekit.serve import ServeOptions, create_app, run_server

    options = ServeOptions(host=host, port=port, api_key=api_key or None, served_model_name=served_model_name,
                           max_waiting=max_waiting, max_body_bytes=max_body_bytes, strict_fields=strict_fields,
                           vllm_metrics=vllm_metrics, tool_format=tool_format)
    ray_flags = (ray_address is not None, replicas != 1, max_replicas is not None, cpus_per_replica != 1)
    if not use_ray and any(ray_flags):
        terminal.fail("--ray-address, --replicas, --max-replicas and --cpus-per-replica need --ray")
    try:
        context = load_context()
        if tensor_parallel_backend is not None and tensor_parallel is None:
            terminal.fail("--tensor-parallel-backend needs --tensor-parallel")
        if tensor_parallel is not None:
            if use_ray:
                terminal.fail("--tensor-parallel splits this server's one engine; --ray serves replicas of their own "
                              "engines on Ray Serve (for ranks placed on a Ray cluster: --tensor-parallel-backend ray)")
            overrides = [*(overrides or []), f"engine.tensor_parallel_size={tensor_parallel}"]
            if tensor_parallel_backend is not None:
                overrides.append(f"engine.tensor_parallel_backend={tensor_parallel_backend}")
        recipe = context.load_recipe(recipe_path, overrides)
        if use_ray:
            from decodekit.serve.ray_serve import ReplicaOptions, import_serve

            import_serve()  # a missing extra fails here, before anything starts
            context.check_models_for_ray(recipe, ray_address)
            scale = ReplicaOptions(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                                   target_ongoing_requests=target_ongoing_requests,
                                   cpus_per_replica=cpus_per_replica, address=ray_address)
            scale.deployment_options()  # contradictory replica options fail here too
        else:
            server = create_app(recipe, options, plugin_manager=context.plugin_manager)
            freeze_startup_heap()  # one engine for the process's life: collections skip what it has built
    except DecodeKitError as exc:
        terminal.fail(str(exc))
    address = f"[{host}]" if ":" in host else host
    names = ", ".join(repr(n) for n in dict.fromkeys(n for n in (served_model_name, recipe.model) if n))
    where = f"http://{address}:{port}/v1{' (API key required)' if options.api_key else ''}"
    if not use_ray:
        terminal.console.print(f"serving {escape(names)} ({escape(recipe.source)}) at {where}", soft_wrap=True,
                               highlight=False)
        run_server(server, options)
        return
    from decodekit.serve.ray_serve import serve_until_signalled

    count = f"{min_replicas}-{max_replicas} autoscaled" if max_replicas is not None else str(replicas)
    terminal.console.print(f"deploying {escape(names)} ({escape(recipe.source)}) on Ray Serve: {count} replicas "
                           f"of {cpus_per_replica} CPU{'s' if cpus_per_replica > 1 else ''}, at {where}",
                           soft_wrap=True, highlight=False)
    try:
        serve_until_signalled(recipe, options, scale, on_ready=lambda: terminal.console.print(
            "ready: every replica is up (Ctrl-C or SIGTERM stops the deployment)"))
    except (DecodeKitError, RuntimeError) as exc:  # Ray Serve reports a deployment that failed as RuntimeError
        terminal.fail(f"the Ray Serve deployment failed: {exc}")

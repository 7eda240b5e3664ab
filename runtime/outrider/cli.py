"""The `outrider` command: serve, health, models, load, unload, plugins, cache, infer, generate,
keygen, bake."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from typing import Any, Optional

from .errors import OutriderError
from .transport import DEFAULT_ADDRESS


def _curve_client(args: argparse.Namespace):
    if not (args.curve_server_key or args.curve_client_key):
        return None
    if not (args.curve_server_key and args.curve_client_key):
        raise OutriderError("give both --curve-server-key and --curve-client-key", code="usage")
    from .transport import CurveClientKeys

    return CurveClientKeys(args.curve_server_key, args.curve_client_key)


def _add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", default=DEFAULT_ADDRESS, metavar="ADDR",
                   help=f"server address (default {DEFAULT_ADDRESS}; env OUTRIDER_ADDRESS)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the reply")
    p.add_argument("--curve-server-key", metavar="FILE", help="server public key file (CURVE)")
    p.add_argument("--curve-client-key", metavar="FILE", help="this client's secret key file (CURVE)")


def cmd_serve(args: argparse.Namespace) -> int:
    # A start's imports build some 70,000 objects that live as long as the process (modules,
    # classes, pydantic's schemas), and the cyclic collector would scan them again and again as
    # they pile up. So it waits until the plugins are registered; then `freeze` puts them out of
    # its sight for good, before any model is built: what a model makes stays collectable, so an
    # unload frees it. The import-time cycles frozen with them are about 160 KB, once.
    collecting = gc.isenabled()
    gc.disable()
    try:
        from . import entry_index, timeline

        entry_index.skip_pydantic_plugin_scan()  # before the core's schemas are built, on import
        from .manifest import load_manifest
        from .plugins import create_registry
        from .protocol import Limits
        from .server import Server, ServerConfig
        from .serving.memory_budget import parse_bytes
        from .transport import CurveServerKeys

        timeline.mark("core imported")

        if not args.manifests and not args.models:
            raise OutriderError("name the manifests to serve, or a directory of them with --models DIR", code="usage")
        if (args.load or args.load_all) and not args.models:
            raise OutriderError("--load and --load-all choose among the models of --models DIR: give --models too",
                                code="usage")
        if args.watch and not args.models:
            raise OutriderError("--watch reloads the changed files of --models DIR: give --models too", code="usage")
        budget = None
        if args.memory_budget:
            try:
                budget = parse_bytes(args.memory_budget)
            except ValueError as exc:
                raise OutriderError(f"--memory-budget: {exc}", code="usage") from None
        registry = create_registry(modules=args.plugin)
        gc.freeze()
    finally:
        if collecting:
            gc.enable()
    timeline.mark("plugins registered")
    manifests = [load_manifest(path, args.set, registry.check_section) for path in args.manifests]
    timeline.mark("manifests validated")
    curve = None
    if args.curve_secret_key or args.curve_allow or args.curve_allow_any:
        if args.curve_allow == "*":
            raise OutriderError(
                "--curve-allow '*' would admit every client key; use --curve-allow-any instead if that is "
                "what you mean (encryption without client authentication)", code="usage")
        if not args.curve_secret_key or bool(args.curve_allow) == bool(args.curve_allow_any):
            raise OutriderError(
                "CURVE needs --curve-secret-key FILE and one of --curve-allow DIR (client public keys) "
                "or --curve-allow-any", code="usage")
        curve = CurveServerKeys(args.curve_secret_key, args.curve_allow, allow_any=args.curve_allow_any)
    limits = Limits(max_message_bytes=args.max_message_mb * 1024 * 1024)
    fronts = []
    http_options = {"api_key_file": args.api_key_file, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
                    "insecure": args.http_insecure, "open_metrics": args.metrics_without_key}
    for spec in ([f"http={args.http}"] if args.http else []) + args.front:
        name, sep, address = spec.partition("=")
        if not sep or not name or not address:
            raise OutriderError(f"--front {spec!r}: expected NAME=ADDRESS, e.g. http=127.0.0.1:8000", code="usage")
        options = {k: v for k, v in http_options.items() if v} if name == "http" else {}
        fronts.append((registry.front(name), address, options))
    if not args.http and not any(s.startswith("http=") for s in args.front) and any(http_options.values()):
        raise OutriderError("--api-key-file, --tls-cert, --tls-key, --http-insecure and --metrics-without-key "
                            "apply to the HTTP front: give --http HOST:PORT too", code="usage")
    load = None if args.load_all else [n for part in args.load for n in part.split(",") if n]
    server = Server(manifests, registry, ServerConfig(
        address=args.bind, limits=limits, curve=curve, drain_timeout=args.drain_timeout,
        metrics_port=args.metrics_port, fronts=fronts, models_dir=args.models, load=load, watch=args.watch,
        memory_budget=budget, overrides=args.set))
    timeline.mark("models built (backends chosen)")
    return server.serve_forever()


def cmd_health(args: argparse.Namespace) -> int:
    from .client import Client

    try:
        with Client(args.connect, timeout=args.timeout, curve=_curve_client(args)) as client:
            health = client.health()
    except OutriderError as exc:
        if args.json:
            print(json.dumps({"ready": False, "status": "unreachable", "error": exc.to_wire()}))
        else:
            print(f"not ready: {exc.message}")
        return 1
    if args.json:
        print(json.dumps(health, indent=2, default=str))
    else:
        print(f"{health['status']}: server {health['server']['version']} pid {health['server']['pid']} on {health['server']['address']}")
        for name, model in health["models"].items():
            line = f"  {name}: {model['state']} ({model['backend']} on {model['device']}, {len(model['instances'])} instance(s))"
            if model.get("reason"):
                line += f" - {model['reason']}"
            print(line)
        for item in health.get("repository", []):
            if item["name"] not in health["models"]:  # not loaded: available, failed, unloading
                line = f"  {item['name']}: {item['state']} (not loaded)"
                if item.get("reason"):
                    line += f" - {item['reason']}"
                print(line)
        for gpu in health.get("devices", []):
            print(f"  {gpu['device']} {gpu['name']}: " + _gpu_line(gpu))
    if args.live:  # the loop answered: alive, whatever its models are doing
        return 0
    return 0 if health.get("ready") else 1


def cmd_models(args: argparse.Namespace) -> int:
    from .client import Client

    with Client(args.connect, timeout=args.timeout, curve=_curve_client(args)) as client:
        index = client.repository()
    if args.json:
        print(json.dumps(index, indent=2))
        return 0
    for item in index:
        line = f"{item['name']:24} {item['state']:10} version {item['version'] or '-'}"
        extras = [k for k in ("load_on_demand",) if item.get(k)]
        if item.get("idle_unload_s"):
            extras.append(f"idle_unload_s={item['idle_unload_s']:g}")
        if extras:
            line += f"  ({', '.join(extras)})"
        if item.get("reason"):
            line += f"  - {item['reason']}"
        print(line)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from .client import Client

    with Client(args.connect, timeout=args.timeout, curve=_curve_client(args)) as client:
        result = client.load(args.model, timeout=args.timeout)
    print(f"{args.model}: {result['state']} (version {result['version']})")
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    from .client import Client

    with Client(args.connect, timeout=args.timeout, curve=_curve_client(args)) as client:
        result = client.unload(args.model, cancel_streams=args.cancel_streams, timeout=args.timeout)
    print(f"{args.model}: {result['state']}")
    return 0


def _gpu_line(gpu: dict) -> str:
    """'4096/143771 MiB, 37% busy, 41 C' and the GPU's error, for what the source reported."""
    parts = []
    if gpu.get("memory_total_mib") is not None:
        parts.append(f"{gpu.get('memory_used_mib')}/{gpu['memory_total_mib']} MiB")
    if gpu.get("utilization_percent") is not None:
        parts.append(f"{gpu['utilization_percent']:g}% busy")
    if gpu.get("temperature_c") is not None:
        parts.append(f"{gpu['temperature_c']:g} C")
    if gpu.get("error"):
        parts.append(f"ERROR: {gpu['error']}")
    return ", ".join(parts) or "no figures"


def cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import create_registry

    registry = create_registry(modules=args.plugin)
    plugins = registry.describe()
    if args.json:
        print(json.dumps(plugins, indent=2))
        return 0
    for p in plugins:
        print(f"{p['name']} {p['version']} ({p['module']})")
        print(f"  hooks: {', '.join(p['hooks'])}")
        for b in p["backends"]:
            status = "available" if b["available"] else f"unavailable: {b['reason']}"
            print(f"  backend {b['name']}: {status}")
        for t in p["tasks"]:
            print(f"  task {t}")
        for f in p.get("fronts", []):
            status = "available" if f["available"] else f"unavailable: {f['reason']}"
            print(f"  front {f['name']}: {status}")
        for a in p["accelerators"]:
            print(f"  accelerator {a['name']}: {a['role']}, section '{a['section']}', backends {', '.join(a['backends'])}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .artifacts import ArtifactCache

    cache = ArtifactCache(args.dir)
    if args.action == "clear":
        removed = cache.clear(args.kind)
        print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.root}")
        return 0
    entries = [e for e in cache.entries() if args.kind is None or e.get("kind") == args.kind]
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
        return 0
    if not entries:
        print(f"{cache.root}: empty")
    for e in entries:
        gate = {k: e[k] for k in ("min_cosine", "mean_cosine", "top1_agreement", "ppl_ratio") if k in e}
        extra = "  " + ", ".join(f"{k} {v:.4f}" for k, v in gate.items()) if gate else ""
        print(f"{e.get('kind')}  {e.get('label')}  {e['bytes'] / 1e6:.1f} MB  built {e.get('created')} "
              f"in {e.get('seconds')} s{extra}\n    {e['path']}")
    return 0


def _parse_input(text: str) -> tuple[str, Any]:
    import numpy as np

    name, sep, value = text.partition("=")
    if not sep:
        raise OutriderError(f"--input {text!r}: expected NAME=JSON, e.g. text='[\"hello\"]'", code="usage")
    try:
        data = json.loads(value)
    except json.JSONDecodeError:
        data = [value]  # a bare string is one BYTES element
    array = np.array(data)
    if array.dtype.kind == "U":
        array = array.astype(object)
    elif array.dtype == np.float64:
        array = array.astype(np.float32)
    return name, array


def cmd_infer(args: argparse.Namespace) -> int:
    from .client import Client

    inputs = dict(_parse_input(t) for t in args.input)
    with Client(args.connect, timeout=args.timeout, curve=_curve_client(args)) as client:
        outputs = client.infer(args.model, inputs)
    print(json.dumps({k: _jsonable(v) for k, v in outputs.items()}))
    return 0


def _jsonable(array: Any) -> Any:
    if array.dtype == object:
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in array.ravel().tolist()]
    return array.tolist()


def cmd_generate(args: argparse.Namespace) -> int:
    from .client import Client, GenerateChunk

    with Client(args.connect, timeout=args.timeout, curve=_curve_client(args)) as client:
        kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k, seed=args.seed, speculative=False if args.no_speculative else None)
        if args.chat:
            kwargs["messages"] = [{"role": "user", "content": args.prompt}]
        else:
            kwargs["prompt"] = args.prompt
        result = None
        for item in client.generate(args.model, stream=True, **kwargs):
            if isinstance(item, GenerateChunk):
                sys.stdout.write(item.text)
                sys.stdout.flush()
            else:
                result = item
        sys.stdout.write("\n")
        if result is not None and args.stats:
            print(json.dumps({"finish_reason": result.finish_reason, **result.stats}), file=sys.stderr)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from .transport import make_keys

    public, secret = make_keys(args.directory, args.name)
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def cmd_bake(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bake import bake
    from .plugins import create_registry

    out = Path(args.out)
    baked = bake(Path(args.manifest), out, create_registry(modules=args.plugin).backends)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{baked}: {size / 1e6:.1f} MB in {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outrider", description="Inference runtime that runs beside your app.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="load, warm up and serve models")
    p.add_argument("manifests", nargs="*", metavar="MANIFEST", help="manifests loaded at start")
    p.add_argument("--models", metavar="DIR",
                   help="a model repository: every *.yaml in DIR may be served; --load or --load-all choose "
                        "what loads at start, the rest are available (outrider load NAME, or load_on_demand)")
    p.add_argument("--load", action="append", default=[], metavar="NAME[,NAME...]",
                   help="with --models: load these at start")
    p.add_argument("--load-all", action="store_true", help="with --models: load every model at start")
    p.add_argument("--watch", action="store_true",
                   help="with --models: reload a changed manifest (or model file) as a new version beside the "
                        "old one, which drains once the new one is ready; add new files, unload removed ones")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="e.g. 2GiB: before a load, unload idle models (least recently used first) until it fits; "
                        "a model that cannot fit is refused with the numbers")
    p.add_argument("--bind", default=DEFAULT_ADDRESS, metavar="ADDR",
                   help=f"address to bind (default {DEFAULT_ADDRESS}); ipc://PATH or tcp://HOST:PORT")
    p.add_argument("--set", action="append", default=[], metavar="[MODEL:]KEY=VALUE",
                   help="override a manifest field, e.g. --set instances=2 (env: OUTRIDER_SET_INSTANCES=2)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="also register this importable module as a plugin")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT")
    p.add_argument("--http", metavar="HOST:PORT",
                   help="also serve HTTP here (Open Inference Protocol v2, OpenAI-compatible routes, /metrics); "
                        "needs outrider[http]")
    p.add_argument("--front", action="append", default=[], metavar="NAME=ADDRESS",
                   help="also serve through the front-end plugin NAME (--http ADDR is --front http=ADDR)")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="HTTP: require 'Authorization: Bearer KEY' with a key of FILE (one per line, or sha256:HEX; "
                        "private to its owner; re-read when it changes) on every route but /v2/health")
    p.add_argument("--metrics-without-key", action="store_true", help="HTTP: /metrics needs no API key")
    p.add_argument("--tls-cert", metavar="FILE", help="HTTP: serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", metavar="FILE", help="HTTP: the certificate's private key (PEM)")
    p.add_argument("--http-insecure", action="store_true",
                   help="HTTP: allow a non-loopback bind without TLS and API keys (a private network only)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight work")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest accepted request, in MiB")
    p.add_argument("--curve-secret-key", metavar="FILE", help="server secret key file; enables CURVE")
    p.add_argument("--curve-allow", metavar="DIR", help="folder of client public keys allowed to connect")
    p.add_argument("--curve-allow-any", action="store_true",
                   help="with CURVE, admit any client key (encrypted, but no client authentication; logs a warning)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("health", help="exit 0 exactly when the server is ready (a Kubernetes exec probe)")
    _add_client_options(p)
    p.set_defaults(timeout=2.0)
    p.add_argument("--json", action="store_true", help="print the full health document")
    p.add_argument("--live", action="store_true",
                   help="exit 0 whenever the server answers, ready or not (a liveness probe: loading, "
                        "degraded and draining servers are alive)")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("models", help="list the server's models, loaded or not, with state and version")
    _add_client_options(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("load", help="load a model of the server's repository and wait until it is ready")
    _add_client_options(p)
    p.set_defaults(timeout=600.0)
    p.add_argument("model")
    p.set_defaults(func=cmd_load)

    p = sub.add_parser("unload", help="unload a model once what it took is answered")
    _add_client_options(p)
    p.add_argument("model")
    p.add_argument("--cancel-streams", action="store_true",
                   help="cancel the model's generations in progress (with a reason) instead of letting them finish")
    p.set_defaults(func=cmd_unload)

    p = sub.add_parser("plugins", help="list plugins, their hooks and whether they can run here")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("cache", help="list or clear the artifact cache (ONNX exports, converted and quantized weights)")
    p.add_argument("action", choices=["list", "clear"])
    p.add_argument("--kind", help="only entries of this kind (e.g. onnx, onnx-int8, llama-weights)")
    p.add_argument("--dir", help="cache directory (default $OUTRIDER_CACHE_DIR or ~/.cache/outrider)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("infer", help="send one infer request")
    _add_client_options(p)
    p.add_argument("model")
    p.add_argument("--input", "-i", action="append", default=[], metavar="NAME=JSON",
                   help='e.g. -i text=\'["a sentence", "another"]\'')
    p.set_defaults(func=cmd_infer)

    p = sub.add_parser("generate", help="generate text, streamed to the terminal")
    _add_client_options(p)
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-speculative", action="store_true")
    p.add_argument("--stats", action="store_true", help="print generation stats to stderr")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("keygen", help="make a CURVE key pair (NAME.key, NAME.key_secret 0600, in a 0700 directory)")
    p.add_argument("directory")
    p.add_argument("--name", default="server")
    p.set_defaults(func=cmd_keygen)

    what = ("write a manifest's model into a directory that serves with no conversion at start "
            "(ONNX Runtime: the exported graph, so serving needs no torch)")
    p = sub.add_parser("bake", help=what, description=what[0].upper() + what[1:] + ".")
    p.add_argument("manifest", metavar="MANIFEST")
    p.add_argument("out", metavar="OUTDIR", help="model directory to write (created)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="also register this importable module as a plugin")
    p.set_defaults(func=cmd_bake)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the `outrider` command."""
    from . import timeline

    timeline.mark("interpreter started and cli imported")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else getattr(logging, os.environ.get("OUTRIDER_LOG_LEVEL", "INFO").upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except OutriderError as exc:
        print(f"outrider {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

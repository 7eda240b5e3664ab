"""Ray Serve: Outrider models as the replicas of a Serve deployment (`pip install 'outrider[ray]'`).

Each replica is one Ray actor that runs an in-process `outrider.server.Server` with the same
manifests and plugins as `outrider serve` (batching and speculative decoding happen inside the
replica), bound to a private `ipc://` socket in the replica's temporary directory. Requests reach
it through `Server.submit`, the path the HTTP front uses: the same queues, limits, deadlines,
cancellation and metrics as a ZeroMQ request, without a second socket hop. Ray Serve routes
requests between replicas, scales their number on the requests each one holds, and replaces a
replica whose health check fails or whose actor dies.

Python, with a handle::

    import numpy as np
    from ray import serve
    from outrider_http import ray_serve as outrider_ray

    app = outrider_ray.deployment(["manifests/minilm.yaml"], autoscaling={"max_replicas": 4})
    handle = serve.run(app, name="outrider", route_prefix="/")
    handle.infer.remote("minilm", {"text": np.array(["hello"], dtype=object)}).result()
    for item in handle.generate.options(stream=True).remote("smollm2", prompt="def f(x):", stream=True):
        ...   # GenerateChunk items, then the GenerateResult (as Client.generate(stream=True))

From the shell, with Serve's own CLI (`build` is the application builder)::

    serve run outrider_http.ray_serve:build manifests=manifests/echo.yaml num_replicas=2

HTTP through Serve's proxy (port 8000 by default): Open Inference Protocol v2
(`POST /v2/models/{name}/infer`, health, metadata), Triton's generate extension
(`POST /v2/models/{name}/generate`, and `.../generate_stream` as server-sent events), the
OpenAI-compatible routes when `sse-starlette` is installed (`outrider[http]`), `/metrics` (the
routes of `outrider serve --http`, from app.py), and `GET /outrider/replica`. Every response
names its replica in `x-outrider-replica` (those routes: ray_routes.py; the replica's identity and
the node-side cleanup of killed replicas' directories: ray_node.py).

docs/RAY.md: multi-node clusters (KubeRay), what stays per node, autoscaling, measured cost.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Sequence, Union

import numpy as np

try:
    import ray
    from ray import serve
    from ray.serve import exceptions as serve_exceptions
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        f"outrider_http.ray_serve needs Ray Serve ({exc}): pip install 'outrider[ray]'"
    ) from exc

from outrider.client import GenerateChunk, GenerateResult, chunk_of, generate_parameters, result_of
from outrider.errors import OutriderError, UnavailableError, error_from_wire
from outrider.front import AsyncCall
from outrider.protocol import encode_tensors

from .ray_node import replica_info, sweep_dead_replica_dirs
from .ray_routes import replica_app

log = logging.getLogger("outrider.ray")

DEPLOYMENT_NAME = "outrider"

#: Requests Serve sends one replica before it waits for answers (Serve's own default is 5). The
#: dynamic batcher can only batch what the replica holds, so this must be at least the largest
#: `batching.max_batch_size` served; Outrider's queue (scheduling.max_queue_size) holds them.
DEFAULT_MAX_ONGOING_REQUESTS = 64

#: Serve's autoscaling on queue length: Serve counts the requests each replica holds (queued in
#: Outrider or executing: Outrider's queue depth plus what its instances run) and keeps their
#: average near `target_ongoing_requests`, between min_replicas and max_replicas.
DEFAULT_AUTOSCALING: dict[str, Any] = {
    "min_replicas": 1,
    "max_replicas": 4,
    "target_ongoing_requests": 16,
    "upscale_delay_s": 10.0,
    "downscale_delay_s": 120.0,
}

#: One CPU per replica unless told otherwise: Ray places replicas by these resources.
DEFAULT_ACTOR_OPTIONS: dict[str, Any] = {"num_cpus": 1}

#: The failures after which a request was not answered by a replica and may be sent again:
#: the replica's actor died or is unreachable, or its Outrider server was shutting down.
RETRYABLE: tuple[type[BaseException], ...] = tuple(cls for cls in (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    getattr(serve_exceptions, "ReplicaUnavailableError", None),
    UnavailableError,
) if cls is not None)

_REPLICA: Optional["OutriderReplica"] = None  # the replica of this actor process, for the ASGI app builder


class OutriderReplica:
    """The body of one replica: an Outrider server in this actor, and the methods handles call.

    `manifests` are paths (read on the replica's node, relative to its working directory) or
    manifest mappings; `plugins` are modules registered beside the entry points that
    OUTRIDER_PLUGINS allows (as `outrider serve --plugin`); `overrides` are `--set` items.
    The constructor returns once every model is ready (so Serve routes nothing to a replica still
    loading), or raises when one failed or `ready_timeout_s` passed (Serve then retries it).
    """

    def __init__(self, manifests: Sequence[Union[str, dict]], plugins: Sequence[str] = (),
                 overrides: Sequence[str] = (), ready_timeout_s: float = 600.0,
                 drain_timeout_s: float = 10.0, address: Optional[str] = None) -> None:
        from outrider.plugins import create_registry
        from outrider.server import Server, ServerConfig

        global _REPLICA
        sweep_dead_replica_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"outrider-ray-{os.getpid()}-")
        self.address = address or f"ipc://{self._dir}/outrider.sock"
        self.drain_timeout_s = drain_timeout_s
        self.server: Any = None
        try:
            loaded = [_load_manifest(m, list(overrides)) for m in manifests]
            self.server = Server(loaded, create_registry(modules=list(plugins)),
                                 ServerConfig(address=self.address, drain_timeout=drain_timeout_s))
            self.server.start()
            self.info = replica_info(self.address)
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self._close(0.0)
            raise
        _REPLICA = self
        log.info("replica %s ready: %s", self.info.get("replica_id"), ", ".join(self.server.models))

    def _wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not self.server.ready:
            health = self.server.health()
            if health["status"] == "failed":
                raise OutriderError(f"Outrider models failed to load: {_reasons(health)}", code="model_not_ready")
            if time.monotonic() > end:
                raise OutriderError(f"Outrider models not ready after {timeout_s:g}s: {_reasons(health)}",
                                    code="model_not_ready")
            time.sleep(0.02)

    # -- what handles call ----------------------------------------------------------------------

    async def infer(self, model: str, inputs: dict[str, Any], **parameters: Any) -> dict[str, np.ndarray]:
        """Run `model` on `inputs` (numpy arrays by name); its outputs by name, as `Client.infer`."""
        specs, buffers = encode_tensors({name: np.asarray(value) for name, value in inputs.items()})
        _, outputs = await self._final(self._submit("infer", model, parameters, specs, buffers))
        return dict(outputs or {})

    async def generate(self, model: str, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
                       max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       seed: Optional[int] = None, stop: Optional[Union[str, list[str]]] = None,
                       speculative: Optional[bool] = None, stream: bool = False,
                       **extra: Any) -> Union[GenerateResult, AsyncIterator[Union[GenerateChunk, GenerateResult]]]:
        """Generate text, as `Client.generate`: the GenerateResult, or with stream=True (and the handle's
        `.options(stream=True)`) GenerateChunk items, then the GenerateResult."""
        if stream:
            return self.stream(model, prompt, messages, max_tokens, temperature, top_p, top_k, seed, stop,
                               speculative, **extra)
        params = generate_parameters(prompt, messages, max_tokens, temperature, top_p, top_k, seed, stop,
                                      speculative, False, extra)
        header, _ = await self._final(self._submit("generate", model, params))
        return result_of(header)

    async def stream(self, model: str, prompt: Optional[str] = None, messages: Optional[list[dict]] = None,
                     max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     seed: Optional[int] = None, stop: Optional[Union[str, list[str]]] = None,
                     speculative: Optional[bool] = None,
                     **extra: Any) -> AsyncIterator[Union[GenerateChunk, GenerateResult]]:
        """Streaming generation (call with `.options(stream=True)`): chunks, then the GenerateResult.
        A caller that stops reading (or is cancelled) cancels the generation and frees its slot."""
        params = generate_parameters(prompt, messages, max_tokens, temperature, top_p, top_k, seed, stop,
                                      speculative, True, extra)
        call = self._submit("generate", model, params, stream=True)
        try:
            while True:
                kind, header, _ = await call.next()
                if kind == "chunk":
                    yield chunk_of(header)
                    continue
                if not header.get("ok", True):
                    raise error_from_wire(header.get("error") or {})
                yield result_of(header)
                return
        finally:
            self._cancel(call)

    def health(self) -> dict[str, Any]:
        """This replica's Outrider health (as `Client.health`), with `replica`: who answered."""
        return {**self.server.health(), "replica": self.info}

    def models(self) -> list[dict[str, Any]]:
        """The served models with readiness, inputs and outputs (as `Client.models`)."""
        return [m.describe() for m in list(self.server.models.values())]

    def replica(self) -> dict[str, Any]:
        """Which replica this is: Serve's replica id, the actor's name and id, node, pid, socket."""
        return dict(self.info)

    def check_health(self) -> None:
        """Serve's health check (every `health_check_period_s`): raises while the server is not ready,
        so Serve stops routing here and replaces the replica after consecutive failures."""
        if self.server is None or not self.server.ready:
            health = self.server.health() if self.server is not None else {"status": "stopped", "models": {}}
            raise UnavailableError(f"Outrider server on {self.address} is not ready: {health['status']}: "
                                   f"{_reasons(health)}")

    def __del__(self) -> None:
        # Serve calls this when the replica is stopped (scale-down, redeploy, shutdown): drain, close.
        self._close(self.drain_timeout_s)

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, kind: str, model: str, parameters: dict, specs: Sequence[dict] = (),
                buffers: Sequence[Any] = (), stream: bool = False, client: bytes = b"ray handle") -> AsyncCall:
        # One client key for handle calls: the model's queue stays FIFO between them (Serve's router,
        # not a connection, decides who gets a replica); HTTP requests use one per connection.
        call = AsyncCall()
        call.request = self.server.submit(kind, model, parameters, specs, buffers, client=client,
                                          on_reply=call.on_reply, on_chunk=call.on_chunk if stream else None)
        return call

    async def _final(self, call: AsyncCall) -> tuple[dict, Optional[dict]]:
        try:
            while True:
                kind, header, outputs = await call.next()
                if kind == "reply":
                    if not header.get("ok", True):
                        raise error_from_wire(header.get("error") or {})
                    return header, outputs
        finally:
            self._cancel(call)

    def _cancel(self, call: AsyncCall) -> None:
        if not call.finished and call.request is not None:  # the caller went away (Serve cancelled us)
            self.server.cancel(call.request, "the Ray Serve caller cancelled the request")

    def _close(self, drain_timeout_s: float) -> None:
        server, self.server = getattr(self, "server", None), None
        if server is not None and getattr(server, "ctx", None) is not None:
            try:
                server.shutdown(drain_timeout_s)
            except Exception:  # noqa: BLE001 - a replica going away must not fail on its way out
                log.exception("Outrider server shutdown failed")
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def asgi_app(self) -> Any:
        """The HTTP routes this replica answers behind Serve's proxy (starlette, from ray[serve])."""
        return replica_app(self.server, self.info)


def _build_asgi_app() -> Any:
    # serve.ingress calls this in each replica after OutriderReplica.__init__ (Ray >= 2.9).
    if _REPLICA is None:
        raise RuntimeError("the Outrider replica of this actor did not start")
    return _REPLICA.asgi_app()


#: The Serve deployment (one replica = one OutriderReplica); `deployment()` sets its options.
OutriderDeployment = serve.deployment(
    name=DEPLOYMENT_NAME,
    max_ongoing_requests=DEFAULT_MAX_ONGOING_REQUESTS,
    ray_actor_options=dict(DEFAULT_ACTOR_OPTIONS),
)(serve.ingress(_build_asgi_app)(OutriderReplica))


def autoscaling_config(autoscaling: Union[bool, dict, None]) -> Optional[dict[str, Any]]:
    """Serve's `autoscaling_config`: None (fixed replicas), True (DEFAULT_AUTOSCALING) or a
    mapping laid over DEFAULT_AUTOSCALING; checked by Serve's own AutoscalingConfig."""
    if autoscaling is None or autoscaling is False:
        return None
    config = dict(DEFAULT_AUTOSCALING)
    if autoscaling is not True:
        if not isinstance(autoscaling, dict):
            raise ValueError(f"autoscaling: expected True or a mapping of Serve autoscaling_config fields, "
                             f"got {autoscaling!r}")
        config.update(autoscaling)
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**config)  # unknown fields and bad ranges fail here, on the caller's side
    return config


def deployment(manifests: Sequence[Union[str, os.PathLike, dict]], plugins: Sequence[str] = (), *,
               overrides: Sequence[str] = (), num_replicas: Optional[int] = None,
               autoscaling: Union[bool, dict, None] = None,
               max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
               ray_actor_options: Optional[dict[str, Any]] = None, runtime_env: Optional[dict[str, Any]] = None,
               name: str = DEPLOYMENT_NAME, ready_timeout_s: float = 600.0, drain_timeout_s: float = 10.0,
               **options: Any) -> Any:
    """The Serve application (`serve.run` takes it) that serves `manifests` on Outrider replicas.

    num_replicas: a fixed count (default 1), or autoscaling: True or a mapping of Serve's
    `autoscaling_config` fields over DEFAULT_AUTOSCALING (`target_ongoing_requests` is the queue
    length per replica Serve aims for). max_ongoing_requests: requests one replica holds at most
    (at least the largest batch size). ray_actor_options: resources per replica (default one CPU;
    `num_gpus` for GPU manifests); runtime_env goes into them. Other keyword arguments are
    `serve.deployment` options (health_check_period_s, graceful_shutdown_timeout_s...).
    """
    if num_replicas is not None and autoscaling:
        raise ValueError("give num_replicas or autoscaling, not both")
    actor_options = {**DEFAULT_ACTOR_OPTIONS, **(ray_actor_options or {})}
    if runtime_env is not None:
        actor_options["runtime_env"] = runtime_env
    config = autoscaling_config(autoscaling)
    opts: dict[str, Any] = {"name": name, "max_ongoing_requests": max_ongoing_requests,
                            "ray_actor_options": actor_options, **options}
    if config is not None:
        if config["target_ongoing_requests"] > max_ongoing_requests:
            raise ValueError(f"autoscaling target_ongoing_requests ({config['target_ongoing_requests']}) is above "
                             f"max_ongoing_requests ({max_ongoing_requests}): a replica would never hold that many")
        opts["autoscaling_config"] = config
    else:
        opts["num_replicas"] = 1 if num_replicas is None else num_replicas
    return OutriderDeployment.options(**opts).bind(
        [_manifest_argument(m) for m in manifests], list(plugins), list(overrides), ready_timeout_s, drain_timeout_s)


def build(args: dict[str, Any]) -> Any:
    """Serve's application builder, for `serve run` and a RayService's serveConfigV2::

        serve run outrider_http.ray_serve:build manifests=manifests/echo.yaml,manifests/minilm.yaml \\
            plugins=my_plugin num_replicas=2
        serve run outrider_http.ray_serve:build manifests=manifests/minilm.yaml \\
            autoscaling='{"max_replicas": 8, "target_ongoing_requests": 16}'

    Arguments (strings from the command line, typed values from YAML): manifests and plugins and
    overrides (comma-separated or lists), num_replicas, autoscaling (true, or a JSON/YAML mapping),
    max_ongoing_requests, num_cpus, num_gpus, ready_timeout_s, name.
    """
    known = {"manifests", "plugins", "overrides", "num_replicas", "autoscaling", "max_ongoing_requests",
             "num_cpus", "num_gpus", "ready_timeout_s", "drain_timeout_s", "name"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"outrider_http.ray_serve:build: unknown arguments {unknown}; known: {sorted(known)}")
    manifests = _list(args.get("manifests"))
    if not manifests:
        raise ValueError("outrider_http.ray_serve:build needs manifests=PATH[,PATH...]")
    autoscaling = args.get("autoscaling")
    if isinstance(autoscaling, str):
        autoscaling = _parse_value(autoscaling)
    actor_options = {}
    for key in ("num_cpus", "num_gpus"):
        if args.get(key) is not None:
            actor_options[key] = float(args[key])
    kwargs: dict[str, Any] = {}
    for key, kind in (("num_replicas", int), ("max_ongoing_requests", int), ("ready_timeout_s", float),
                      ("drain_timeout_s", float), ("name", str)):
        if args.get(key) is not None:
            kwargs[key] = kind(args[key])
    return deployment(manifests, _list(args.get("plugins")), overrides=_list(args.get("overrides")),
                      autoscaling=autoscaling or None, ray_actor_options=actor_options, **kwargs)


def call(method: Any, *args: Any, attempts: int = 5, backoff_s: float = 0.05, timeout_s: Optional[float] = None,
         on_retry: Optional[Callable[[BaseException, int], None]] = None, **kwargs: Any) -> Any:
    """`method.remote(*args, **kwargs).result()`, sent again when no replica answered it (RETRYABLE:
    the replica's actor died or was unreachable, or its server was shutting down), up to `attempts`
    times with exponential back-off; `on_retry(exception, attempt)` is told each time. For requests
    that may run twice (infer is stateless): one whose replica died mid-way may have run there too.

        outputs = outrider_ray.call(handle.infer, "echo", {"x": np.arange(3)})
    """
    for attempt in range(1, attempts + 1):
        try:
            return method.remote(*args, **kwargs).result(timeout_s=timeout_s)
        except RETRYABLE as exc:
            if attempt >= attempts:
                raise
            _retrying(exc, attempt, attempts, on_retry)
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


async def call_async(method: Any, *args: Any, attempts: int = 5, backoff_s: float = 0.05,
                     on_retry: Optional[Callable[[BaseException, int], None]] = None, **kwargs: Any) -> Any:
    """`await method.remote(...)` with the retries of `call`, for asyncio callers (and other deployments)."""
    for attempt in range(1, attempts + 1):
        try:
            return await method.remote(*args, **kwargs)
        except RETRYABLE as exc:
            if attempt >= attempts:
                raise
            _retrying(exc, attempt, attempts, on_retry)
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


def _retrying(exc: BaseException, attempt: int, attempts: int,
              on_retry: Optional[Callable[[BaseException, int], None]]) -> None:
    log.info("no replica answered (%s: %s); sending again (attempt %d of %d)", type(exc).__name__,
             str(exc).splitlines()[0][:200] if str(exc) else "", attempt + 1, attempts)
    if on_retry is not None:
        on_retry(exc, attempt)


# -- helpers ---------------------------------------------------------------------------------------


def _load_manifest(manifest: Union[str, dict], overrides: list[str]) -> Any:
    from outrider.manifest import apply_overrides, load_manifest, validate_manifest

    if isinstance(manifest, dict):  # given inline: the same env and --set overrides as a file
        data = json.loads(json.dumps(manifest))
        where = f"<manifest {data.get('name', '?')}>"
        return validate_manifest(apply_overrides(data, overrides, where), where)
    return load_manifest(manifest, overrides)


def _manifest_argument(manifest: Union[str, os.PathLike, dict]) -> Union[str, dict]:
    if isinstance(manifest, dict):
        return manifest
    path = Path(manifest)
    # A relative path that exists here is made absolute (the replicas' working directory may differ
    # on this node); otherwise it is left for each replica's node to resolve.
    return str(path.resolve()) if not path.is_absolute() and path.exists() else str(path)


def _reasons(health: dict) -> str:
    parts = []
    for name, model in health.get("models", {}).items():
        part = f"{name} {model.get('state')}"
        if model.get("reason"):
            part += f" ({model['reason']})"
        parts.append(part)
    return "; ".join(parts) or "no models"


def _list(value: Any) -> list:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return list(value)


def _parse_value(text: str) -> Any:
    import yaml

    lowered = text.strip().lower()
    if lowered in ("", "false", "no", "off", "0"):
        return None
    if lowered in ("true", "yes", "on", "1"):
        return True
    return yaml.safe_load(text)  # JSON is YAML


__all__ = [
    "DEFAULT_AUTOSCALING",
    "DEFAULT_MAX_ONGOING_REQUESTS",
    "OutriderDeployment",
    "OutriderReplica",
    "RETRYABLE",
    "autoscaling_config",
    "build",
    "call",
    "call_async",
    "deployment",
]

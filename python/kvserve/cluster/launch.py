"""``kvserve serve --replicas N``: starts (or joins) Ray, deploys N replicas as Ray Serve
deployments (one deployment each, ``kvserve-replica-<i>``, so that the router can address
each one), and serves the ingress (:mod:`kvserve.cluster.ingress`) on ``--host``/``--port``
with uvicorn until interrupted; then deletes the deployments (and stops the local Ray it
started). Ray is imported only here: ``pip install kvserve[cluster]``."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from types import ModuleType
from typing import Any

from ..server import ServerConfig, configure_logging
from .ingress import create_ingress
from .replica import ReplicaServer
from .router import Router

__all__ = ["ClusterUnavailable", "import_ray", "serve_replicas"]

log = logging.getLogger("kvserve.cluster")

INSTALL_HINT = "pip install kvserve[cluster]"


class ClusterUnavailable(RuntimeError):
    """Ray Serve is not installed (``--replicas`` needs ``pip install kvserve[cluster]``)."""


def import_ray() -> tuple[ModuleType, ModuleType]:
    """``(ray, ray.serve)``, or :class:`ClusterUnavailable` naming the extra to install."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ClusterUnavailable(
            f"--replicas runs replicas on Ray Serve, which is not installed ({e});"
            f" install it with: {INSTALL_HINT}"
        ) from None
    return ray, serve


def serve_replicas(
    config: ServerConfig,
    replicas: int,
    *,
    ray_address: str | None = None,
    replica_cpus: float | None = None,
    poll_s: float = 0.25,
    imbalance: int = 4,
) -> None:
    """Serve ``config`` as ``replicas`` (>= 2) replicas behind one ingress (module docs).
    Every replica gets the whole ``config`` (model, K/V memory and tiers, tenants, limits, and
    any engine option it carries). ``ray_address``: an existing Ray cluster (``auto`` or
    ``ray://HOST:PORT``; kvserve and the model file must be there on every node); None starts
    a local Ray instance. ``replica_cpus``: the CPUs Ray reserves per replica (default: its
    threads, else 1)."""
    if replicas < 2:
        raise ValueError(f"--replicas needs at least 2 replicas, got {replicas}")
    ray, serve = import_ray()
    import uvicorn
    from ray.serve.api import RunTarget

    from ..server.linger import LingeringH11Protocol

    configure_logging(config.log_format)
    cpus = replica_cpus if replica_cpus is not None else float(config.threads or 1)
    t0 = time.monotonic()
    init: dict[str, Any] = {"include_dashboard": False, "configure_logging": False}
    if ray_address is None:
        # Logical CPUs for the replicas and Serve's own actors, whatever the machine has.
        init["num_cpus"] = max(os.cpu_count() or 1, int(replicas * cpus) + 1)
        pythonpath = os.environ.get("PYTHONPATH")
        if pythonpath:  # kvserve from a source tree: the workers import the same one
            init["runtime_env"] = {"env_vars": {"PYTHONPATH": pythonpath}}
    # "local": a new instance even when RAY_ADDRESS names a running one.
    try:
        ray.init(address=ray_address or "local", **init)
    except ConnectionError as e:
        if ray_address is None or os.environ.get("RAY_AUTH_MODE"):
            raise
        raise ConnectionError(
            f"{e}. If the cluster uses token authentication (`ray start` enables it by default"
            " from Ray 2.59), set RAY_AUTH_MODE=token here too; the token comes from"
            " RAY_AUTH_TOKEN or ~/.ray/auth_token"
        ) from e
    try:
        serve.start(proxy_location="Disabled")  # the ingress below is the HTTP server
        t_ray = time.monotonic() - t0
        fields = dataclasses.asdict(config)
        fields["cors_origins"] = None  # the ingress answers for CORS (no headers twice)
        deployment = serve.deployment(ReplicaServer)
        names = [f"kvserve-replica-{i}" for i in range(replicas)]
        targets = [
            RunTarget(
                deployment.options(
                    name=name,
                    num_replicas=1,
                    # The engine queues and batches itself: let every request through.
                    max_ongoing_requests=config.parallel + config.max_queue + 8,
                    ray_actor_options={"num_cpus": cpus},
                    # The ingress polls KV events several times a second: no access log line
                    # per call.
                    logging_config={"enable_access_log": False},
                ).bind(name, fields),
                name=name,
                route_prefix=None,
            )
            for name in names
        ]
        handles = serve.run_many(targets)
        log.info(
            "Ray up in %.1fs, %d replicas deployed in %.1fs more",
            t_ray, replicas, time.monotonic() - t0 - t_ray,
        )  # fmt: skip
        app = create_ingress(
            config,
            dict(zip(names, handles, strict=True)),
            router=Router(imbalance=imbalance),
            poll_s=poll_s,
        )
        uvicorn.run(
            app,
            host=config.host,
            port=config.port,
            http=LingeringH11Protocol,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=int(config.shutdown_grace) + 2,
        )
    finally:
        try:
            for name in [f"kvserve-replica-{i}" for i in range(replicas)]:
                serve.delete(name, _blocking=False)
            if ray_address is None:
                serve.shutdown()
        finally:
            ray.shutdown()

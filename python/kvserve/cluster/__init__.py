"""kvserve as several replicas routed by cache affinity (docs/CLUSTER.md).

- :mod:`kvserve.cluster.router`: the routing policy (pure Python: longest cached prefix
  unless load is imbalanced, then power of two choices; sticky sessions), fed by the
  replicas' KV events.
- :mod:`kvserve.cluster.replica`: one replica, the single-box server inside a Ray Serve
  deployment.
- :mod:`kvserve.cluster.ingress`: the OpenAI-compatible ingress that forwards each request
  to the replica the router picks.
- :mod:`kvserve.cluster.launch`: ``kvserve serve --replicas N`` (Ray, imported only there:
  ``pip install kvserve[cluster]``).

Importing this package never imports Ray.
"""

from __future__ import annotations

from .router import Choice, Router

__all__ = ["Choice", "Router"]

"""areal-gateway: an OpenAI-compatible HTTP front to the mesh that records token-exact
trajectories, so agents written against the ``openai`` package train without importing us.

Endpoints (bearer auth when an API key is set):

* ``GET /v1/models``; ``POST /v1/chat/completions`` (``messages``, ``n``, ``temperature``,
  ``top_p``, ``max_tokens`` / ``max_completion_tokens``, single-token ``stop``, ``logprobs``);
  ``POST /v1/completions``. Each choice carries ``completion_id`` (the response id for
  ``n`` = 1, ``<id>:<index>`` otherwise) and, with ``return_token_ids``, its ``token_ids``.
* ``POST /rl/sessions`` takes a coordinator lease; completions sent with ``X-Session-Id`` are
  generated at the lease's rollout server and recorded; ``POST /rl/sessions/{id}/reward``
  submits the session's conversations as one trajectory group; ``DELETE /rl/sessions/{id}``
  releases the lease.
"""

from .app import create_app

__all__ = ["create_app"]

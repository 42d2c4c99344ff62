"""halfmoon router: what clients call (docs/architecture.md, Parts; A request's path, steps 1, 5 and
6). Talks to workers only over gRPC.

Files (one concept each):
  main.py           `halfmoon serve-router`: gRPC server (Router + health + reflection), OpenAI HTTP
                    (uvicorn, same event loop), /metrics
  grpc_service.py   halfmoon.v1.Router servicer: Generate (stream), Abort, ListModels, ListWorkers
  openai_api.py     FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, SSE, OpenAI errors
  validation.py     request -> PreparedRequest (token ids, sampling with max_tokens); INVALID_ARGUMENT
                    naming the field, before anything reaches a worker
  errors.py         RouterError (gRPC code, message, param) and its OpenAI/HTTP mapping
  tokenizer.py      HF tokenizer + chat template of the model; context window
  dispatch.py       Dispatcher: a client request's lifecycle (ids per tenant, Abort, admission, counts)
  attempts.py       Attempts: pick P and D, mint the room, concurrent legs, first chunk, retry once,
                    Abort both legs
  relay.py          Relay: D's stream to the client after the first token, through engine.detokenizer
                    (UTF-8 safe deltas, stop strings removed); migration when D fails mid-stream
  pool.py           WorkerPool: static list or registry WatchWorkers; health checks and GetLoad polling
  worker.py         Worker: router-side state of one worker (stub, health, load)
  policies.py       round_robin, least_load, power_of_two, cache_aware (one per role)
  prefix_index.py   page-aligned prefix index per worker for cache_aware (engine.kvcache.page_hash keys)
  front_door.py     the front door's flags: API keys, rate limit, admission queue, request size
  api_keys.py       ApiKeys: key file / --api-key / $HALFMOON_API_KEY -> tenants (digests, constant time)
  grpc_auth.py      aio interceptor: Router RPCs need 'authorization: Bearer <key>'; current_tenant()
  http_guard.py     ASGI middleware: /v1/* need 'Authorization: Bearer <key>' (401); body size (413)
  admission.py      per-tenant token bucket and the admission queue bound (429 / RESOURCE_EXHAUSTED)
"""

"""dsc.serve: the OpenAI-compatible HTTP server (`dsc serve`) and its load generator
(`dsc bench-serve`). Needs the `serve` extra (fastapi, uvicorn, prometheus-client, openai).

    app.py       the FastAPI app: endpoints, OpenAI error bodies, streaming
    protocol.py  request and response bodies (pydantic)
    driver.py    the engine thread and its inbox
    metrics.py   Prometheus metrics
    server.py    uvicorn, signals, graceful shutdown
    bench.py     the load generator (Poisson arrivals, TTFT / ITL / E2E percentiles)
"""
